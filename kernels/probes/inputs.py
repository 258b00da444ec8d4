"""What every probe (kernels/probes/checks.py, kernels/probes/mla.py) builds its inputs and judges its
result with: seeded inputs on the worker's device, scrambled block tables, the error measure."""

import numpy as np
import torch

from xinserve.kernels.kv_quant import is_quantized


class ProbeInputs:
    """Seeded random tensors made on the host (so every device sees the same values) and copied."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.generator = torch.Generator().manual_seed(0)

    def randn(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(self.device, dtype or self.dtype)


def max_error(candidate: object, expected: object) -> float:
    """Max abs difference over (nested tuples of) tensors; inf when the -inf patterns differ."""
    if isinstance(expected, tuple):
        return max(max_error(c, e) for c, e in zip(candidate, expected, strict=True))
    got, want = candidate.detach().float().cpu(), expected.detach().float().cpu()
    if got.shape != want.shape:
        return float("inf")
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    return float((got[finite] - want[finite]).abs().max()) if finite.any() else 0.0


def to_host32(value: object) -> object:
    """A tensor as the float32 reference takes it: on the host, floating values widened (an 8-bit KV
    cache's rows stay as they are: the reference reads them)."""
    if isinstance(value, torch.Tensor):
        widen = value.is_floating_point() and not is_quantized(value.dtype)
        return value.detach().cpu().float() if widen else value.detach().cpu()
    return value


def scrambled_block_tables(lens: list[int], block_size: int, num_blocks: int, seed: int) -> np.ndarray:
    """[S, B] int32 tables over a scrambled pool of num_blocks (rows zero-padded), so no kernel can
    rely on contiguous blocks."""
    needed = [-(-n // block_size) for n in lens]
    order = np.random.default_rng(seed).permutation(num_blocks)[: sum(needed)]
    width = max(needed)
    table, start = np.zeros((len(lens), width), np.int32), 0
    for i, n in enumerate(needed):
        table[i, :n] = order[start : start + n]
        start += n
    return table


def pool_size(lens: list[int], block_size: int) -> int:
    """KV blocks for contexts of these lengths, at least 8 (so the tables can scramble)."""
    return max(8, sum(-(-n // block_size) for n in lens))
