"""The function a decode bucket compiles: one decode step of ``model`` over ``kv_cache``.

Module-level, with the model and the KV cache as arguments rather than in a closure, so that its
compiled form can be saved by one process and loaded by another (``torch.compile(...).aot_compile``:
engines/compile/artifacts.py): the loader passes its own model and cache, and nothing of either is
pickled with the artifact (their parameters are read at each call, their shapes are checked once by
the artifact's guards).
"""

import torch

from xinserve.kernels.attention_metadata import AttentionMetadata


def decode_step(model: torch.nn.Module, kv_cache: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, V], the final hidden states [B, hidden], which the MTP drafter reads:
    engines/speculative/mtp_runner.py) for input_ids [B] at positions [B]."""
    # ``forward``, not ``__call__``: a runner's forward hooks (the MTP runner's) are neither traced into the
    # bucket nor fired by a compile or timing run.
    hidden = model.forward(input_ids, positions, kv_cache, metadata)
    return model.compute_logits(hidden), hidden
