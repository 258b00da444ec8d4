"""What one rank of a replica computes, as /health shows it: its tensor-parallel rank, its pipeline
stage and the routed experts it holds whole. Pipeline and expert parallelism fill the last two; until
a replica uses them every rank is stage 0 and holds a slice of every expert (``expert_range`` None)."""

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RankRole:
    tp_rank: int
    pp_stage: int = 0
    # The routed experts held whole ("0-3", or "3,6,1,4" when placed out of order); None: a slice of all
    expert_range: str | None = None
    layers: str | None = None  # with a pipeline: the stage's decoder layers, "first-last"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
