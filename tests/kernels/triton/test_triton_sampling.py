"""The Triton top-k / top-p filter (kernels/triton/sampling.py) under Triton's interpreter: equal to the
reference on rows of mixed settings in one batch (top_k 0 and top_p 1 keep all, k = 1, k with p, p alone)
at a vocabulary of 300 and of 32003 (neither a multiple of a tile), with -inf logits in a row; ties at the
top-k cut kept as the reference keeps them, a tie group at the top-p cut kept whole (the reference keeps
the part its sort puts last); float16 / bfloat16 logits filtered as their float32 values; accepted by
the registry's probe, which rejects top-p taken before top-k's renormalisation."""

import pytest
import torch

from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import probe_top_k_top_p
from xinserve.kernels.probes.inputs import ProbeInputs
from xinserve.kernels.references import dense as reference
from xinserve.kernels.triton import OPS
from xinserve.kernels.triton.sampling import top_k_top_p

CPU = torch.device("cpu")
# (top_k, top_p) per row: keep all, k = 1, k then p, p alone, k alone, k = V - 1, p near 0
SETTINGS = [(0, 1.0), (1, 1.0), (5, 0.9), (0, 0.5), (50, 1.0), (-1, 0.8), (0, 1e-6)]


def settings(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k [N, 1] int64 (-1 stands for V - 1) and top_p [N, 1] float32 of SETTINGS."""
    top_k = torch.tensor([[vocab_size - 1 if k < 0 else k] for k, _ in SETTINGS], dtype=torch.int64)
    return top_k, torch.tensor([[p] for _, p in SETTINGS], dtype=torch.float32)


def distinct_logits(rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """[rows, V] float32, no two equal in a row (ties are tested on their own)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([3 * torch.randperm(vocab_size, generator=gen).float() / vocab_size * 4 - 6
                        for _ in range(rows)]) + 0.25 * torch.randn(rows, 1, generator=gen)


@pytest.mark.parametrize("vocab_size", [300, 32003])
def test_mixed_rows_equal_the_reference(vocab_size) -> None:
    logits = distinct_logits(len(SETTINGS), vocab_size)
    logits[2, ::7] = float("-inf")  # banned tokens: never kept, and no part of the mass
    top_k, top_p = settings(vocab_size)
    got = top_k_top_p(logits, top_k, top_p)
    want = reference.top_k_top_p(logits, top_k, top_p)
    assert torch.equal(got, want)
    kept = torch.isfinite(got).sum(dim=1).tolist()
    assert kept[0] == vocab_size and kept[1] == 1 and kept[4] == 50 and kept[6] == 1
    assert torch.equal(got[0], logits[0])  # nothing touched where nothing is filtered


def test_ties_at_the_top_k_cut_are_all_kept_as_the_reference_keeps_them() -> None:
    logits = torch.tensor([[0.5, 2.0, 1.0, 1.0, 3.0, 1.0, -1.0]])
    top_k, top_p = torch.tensor([[3]]), torch.tensor([[1.0]])
    got = top_k_top_p(logits, top_k, top_p)
    assert torch.equal(got, reference.top_k_top_p(logits, top_k, top_p))
    assert torch.isfinite(got).tolist() == [[False, True, True, True, True, True, False]]


def test_a_tie_group_at_the_top_p_cut_is_kept_whole() -> None:
    # probabilities ~ [0.5, 0.125 x 4]: p = 0.6 cuts inside the group of four equal logits
    logits = torch.tensor([[2.0794415, 0.6931472, 0.6931472, 0.6931472, 0.6931472, -20.0]])
    top_k, top_p = torch.tensor([[0]]), torch.tensor([[0.6]])
    kept = torch.isfinite(top_k_top_p(logits, top_k, top_p))
    reference_kept = torch.isfinite(reference.top_k_top_p(logits, top_k, top_p))
    assert kept.tolist() == [[True, True, True, True, True, False]]
    assert 1 < int(reference_kept.sum()) < 5 and bool((kept | ~reference_kept).all())  # a part of the group


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_logits_are_filtered_as_their_float32_values(dtype) -> None:
    logits = distinct_logits(3, 300, seed=1).to(dtype)
    top_k, top_p = (t[1:4] for t in settings(300))  # k = 1; k then p; p alone
    got = top_k_top_p(logits, top_k, top_p)
    assert got.dtype == dtype
    assert torch.equal(got, top_k_top_p(logits.float(), top_k, top_p).to(dtype))


def test_an_empty_batch_is_empty() -> None:
    empty = torch.empty(0, 1, dtype=torch.int64)
    assert top_k_top_p(torch.empty(0, 300), empty, empty.float()).shape == (0, 300)


@pytest.mark.parametrize("vocab_size", [300, 32003])
def test_the_registry_probe_accepts_it(vocab_size) -> None:
    shapes = ModelShapes(num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=8, rope_is_neox=True, hidden_size=32,
                         intermediate_size=48, vocab_size=vocab_size, block_size=16)
    assert probe_top_k_top_p(OPS, shapes, ProbeInputs(CPU, torch.bfloat16)) == 0.0


def test_the_probe_rejects_top_p_taken_over_the_whole_vocabulary() -> None:
    """The classic mistake: the top-p mass counted before top-k, not renormalised over the kept tokens."""
    def unrenormalised(logits, top_k, top_p):
        by_p = reference.top_k_top_p(logits, torch.zeros_like(top_k), top_p)
        by_k = reference.top_k_top_p(logits, top_k, torch.ones_like(top_p))
        return torch.where(torch.isfinite(by_p) & torch.isfinite(by_k), logits, float("-inf"))

    shapes = ModelShapes(num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=8, rope_is_neox=True, hidden_size=32,
                         intermediate_size=48, vocab_size=300, block_size=16)
    assert probe_top_k_top_p({"top_k_top_p": unrenormalised}, shapes, ProbeInputs(CPU, torch.float32)) == float("inf")
