"""The checkpoints of pooling models, on our causal decoders: a bare decoder (``Qwen3Model``: names
without ``model.``, no LM head, as sentence-transformers saves one) and a sequence classifier
(``Qwen3ForSequenceClassification``: a ``score`` head [num_labels, hidden] in place of the LM head)."""

from functools import cache
from typing import Any

import torch
from torch import nn

from xinserve.engines.models.decoder import CausalLM
from xinserve.kernels.ops import REFERENCE_OPS, KernelOps

CLASSIFIER_SUFFIX = "ForSequenceClassification"
BARE_SUFFIX = "Model"


@cache
def bare_decoder(base: type[CausalLM]) -> type[CausalLM]:
    """``base`` reading a checkpoint whose names may lack the ``model.`` prefix and that may hold no LM
    head. Its logits (read by the warm-up only) reuse the embedding, as a tied head would."""

    class BareDecoder(base):
        def __init__(self, config: Any, ops: KernelOps = REFERENCE_OPS) -> None:
            super().__init__(config, ops)
            self.lm_head = None

        def _skipped(self, name: str) -> bool:
            return name == "lm_head.weight" or super()._skipped(name)

        def _target(self, name: str) -> tuple[str, int | None, int | None]:
            return super()._target(name if name.startswith("model.") else f"model.{name}")

    BareDecoder.__name__ = BareDecoder.__qualname__ = base.__name__.removesuffix("ForCausalLM") + BARE_SUFFIX
    return BareDecoder


@cache
def sequence_classifier(base: type[CausalLM]) -> type[CausalLM]:
    """``base`` with Hugging Face's ``score`` head: ``compute_logits`` gives [N, num_labels] float32."""

    class SequenceClassifier(base):
        def __init__(self, config: Any, ops: KernelOps = REFERENCE_OPS) -> None:
            super().__init__(config, ops)
            self.lm_head = None
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)

        def _skipped(self, name: str) -> bool:
            return name == "lm_head.weight" or super()._skipped(name)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            """hidden: [N, hidden] -> [N, num_labels] float32."""
            return self.ops.linear(hidden, self.score.weight).float()

    SequenceClassifier.__name__ = base.__name__.removesuffix("ForCausalLM") + CLASSIFIER_SUFFIX
    SequenceClassifier.__qualname__ = SequenceClassifier.__name__
    return SequenceClassifier


def model_class(registry: dict[str, type[CausalLM]], architecture: str | None) -> type[CausalLM] | None:
    """The class for ``architecture``: a causal LM of ``registry``, or a pooling form of one (``<Base>Model``,
    ``<Base>ForSequenceClassification``); None when neither."""
    if architecture in registry:
        return registry[architecture]
    if architecture is None:
        return None
    for suffix, wrap in ((CLASSIFIER_SUFFIX, sequence_classifier), (BARE_SUFFIX, bare_decoder)):
        base = registry.get(architecture.removesuffix(suffix) + "ForCausalLM")
        if architecture.endswith(suffix) and base is not None:
            return wrap(base)
    return None
