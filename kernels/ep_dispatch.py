"""Which token exchange expert parallel uses: a fused vendor dispatch / combine where the platform has
one (its ``ep_dispatch_preference``, owned by its module in engines/platforms/) and the model's shapes
fit its documented limits, else the ``all_to_all`` reference (engines/models/expert_parallel.py). Like the registry's choices it keeps every rejection's reason
for the start-up log, ``/health`` and ``xinserve doctor``. The candidates are not probed: a probe
would need the whole group; the two-rank test against the fake checks them against the reference."""

import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.registry import KernelSelection

logger = logging.getLogger(__name__)

REFERENCE = "all_to_all"
# implementation name -> module exposing ``unsupported`` and ``dispatch_combine``
MODULES = {"npu_moe_dispatch": "xinserve.kernels.ascend.moe_dispatch"}


@dataclass(slots=True)
class EpDispatchChoice:
    chosen: str
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (implementation, reason)

    def record(self, selection: KernelSelection) -> str:
        """Add the choice to the kernel report as the op ``ep_dispatch``, log it; return the name."""
        selection.chosen["ep_dispatch"] = self.chosen
        if self.rejected:
            selection.rejected["ep_dispatch"] = self.rejected
        logger.info("expert parallel exchange: %s%s", self.chosen,
                    "".join(f" ({name} rejected: {reason})" for name, reason in self.rejected))
        return self.chosen


def choose_ep_dispatch(preference: Sequence[str], world_size: int, shapes: ModelShapes, dtype: torch.dtype,
                       max_num_batched_tokens: int) -> EpDispatchChoice:
    """The exchange for ``world_size`` expert-parallel ranks: the first candidate of ``preference`` (names
    in MODULES, most preferred first, the reference last) that imports and accepts the shapes."""
    rejected = []
    top_k = shapes.moe_routing.top_k if shapes.moe_routing is not None else 0
    per_rank = -(-max_num_batched_tokens // world_size)  # a rank's chunk of the largest step
    for name in preference:
        if name == REFERENCE:
            break
        try:
            module = importlib.import_module(MODULES[name])
        except ImportError as exc:
            rejected.append((name, f"not installed ({exc})"))
            continue
        reason = module.unsupported(world_size, shapes.num_experts, top_k, shapes.hidden_size, dtype, per_rank)
        if reason is None:
            return EpDispatchChoice(name, rejected)
        rejected.append((name, reason))
    return EpDispatchChoice(REFERENCE, rejected)
