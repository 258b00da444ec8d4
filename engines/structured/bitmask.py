"""Masking the logits of grammar-constrained rows to the tokens their grammar allows next."""

import torch
import xgrammar

from xinserve.engines.structured.compiler import OutputGrammar


def apply_grammars(logits: torch.Tensor, grammars: list[OutputGrammar | None]) -> torch.Tensor:
    """A copy of ``logits`` ([N, V] float32) with each constrained row's disallowed tokens at -inf.

    ``grammars``: one per row, None for an unconstrained row (left untouched). The bitmask is filled
    on the host from each grammar's state and goes host -> device; nothing comes back.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    vocab_size = logits.shape[1]
    bitmask = xgrammar.allocate_token_bitmask(len(grammars), vocab_size)  # [N, ceil(V / 32)] int32
    for i in rows:
        grammars[i].matcher.fill_next_token_bitmask(bitmask, i)
    bitmask &= grammars[rows[0]].json_tokens  # one vocabulary per worker, so one filter for every row
    logits = logits.clone()  # the raw logits stay unmasked for log-probs
    xgrammar.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab_size, indices=rows
    )
    return logits
