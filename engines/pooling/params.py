"""What a pooling request asks for (vLLM's ``PoolingParams``): its task and how its vector is shaped."""

from dataclasses import dataclass
from typing import Literal

PoolingTask = Literal["embed", "classify"]


@dataclass(slots=True)
class PoolingParams:
    """``task``: "embed" (a vector per input) or "classify" (a probability per label; a cross-encoder's
    one relevance score). ``dimensions``: keep the first N of an embedding (Matryoshka), normalized
    again; refused by the engine when the model declares no Matryoshka support. ``normalize``: None
    follows the model (its sentence-transformers Normalize module, else the architecture's default).
    ``activation``: classify's softmax (sigmoid for one label); False returns the raw logits."""

    task: PoolingTask = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool = True

    def __post_init__(self) -> None:
        if self.task not in ("embed", "classify"):
            raise ValueError(f"task must be embed or classify, got {self.task!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")
