"""The Triton rotary embedding (kernels/triton/rotary.py) under Triton's interpreter: query and key rotated in
one launch equal the reference for neox and GPT-J pairing, full and partial rotary_dim, GQA, 1 and 33 tokens,
on query / key slices of a fused qkv projection; out of place; accepted by the registry's probe, which
rejects the wrong pairing style."""

import pytest
import torch

from tests.kernels.triton.fused_checks import DTYPES, assert_close
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import TOLERANCE, probe_rotary
from xinserve.kernels.probes.inputs import ProbeInputs
from xinserve.kernels.references import dense as reference
from xinserve.kernels.triton import OPS, unsupported
from xinserve.kernels.triton.rotary import rotary_cos_sin, rotary_embedding

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 40  # GQA 3:1, a head dim that is no power of two


def cos_sin_cache(rotary_dim: int, positions: int = 64) -> torch.Tensor:
    """[positions, rotary_dim] float32: cos then sin of each pair's angle, as the model builds it."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def fused_qkv(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D] and key [T, KVH, D] as views of one [T, (H + 2 KVH) D] projection (not contiguous)."""
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    return (qkv[:, :q_size].view(tokens, HEADS, HEAD_DIM),
            qkv[:, q_size : q_size + kv_size].view(tokens, KV_HEADS, HEAD_DIM))


# (tokens, is_neox, rotary_dim): each style full and partial, a lone decode token and 33 tokens
CASES = [(1, True, HEAD_DIM), (33, True, 16), (33, False, HEAD_DIM), (5, False, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, is_neox, rotary_dim", CASES, ids=["1-neox-full", "33-neox-partial",
                                                                     "33-gptj-full", "5-gptj-partial"])
def test_query_and_key_equal_the_reference(dtype, tokens, is_neox, rotary_dim) -> None:
    query, key = fused_qkv(tokens, dtype)
    positions = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(2))
    table = rotary_cos_sin(positions, cos_sin_cache(rotary_dim), is_neox, dtype)
    before = (query.clone(), key.clone())
    got_q, got_k = rotary_embedding(query, key, table, is_neox)
    want_q, want_k = reference.rotary_embedding(query, key, table, is_neox)
    assert_close(got_q, want_q)
    assert_close(got_k, want_k)
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])  # out of place
    if rotary_dim < HEAD_DIM:  # the dims past rotary_dim pass through as they are
        assert torch.equal(got_q[..., rotary_dim:], query[..., rotary_dim:])


def test_an_empty_step_returns_empty_tensors() -> None:
    query, key = torch.empty(0, HEADS, HEAD_DIM), torch.empty(0, KV_HEADS, HEAD_DIM)
    table = rotary_cos_sin(torch.empty(0, dtype=torch.int64), cos_sin_cache(HEAD_DIM), True, torch.float32)
    got_q, got_k = rotary_embedding(query, key, table, True)
    assert got_q.shape == query.shape and got_k.shape == key.shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox, rotary_dim", [(True, 64), (False, 32)], ids=["neox-full", "gptj-partial"])
def test_the_registry_probe_accepts_it(dtype, is_neox, rotary_dim) -> None:
    shapes = ModelShapes(num_heads=8, num_kv_heads=2, head_dim=64, rotary_dim=rotary_dim, rope_is_neox=is_neox,
                         hidden_size=128, intermediate_size=96, vocab_size=300, block_size=16)
    assert probe_rotary(OPS, shapes, ProbeInputs(CPU, dtype)) <= TOLERANCE[dtype]


def test_the_probe_rejects_the_wrong_pairing_style() -> None:
    shapes = ModelShapes(num_heads=8, num_kv_heads=2, head_dim=64, rotary_dim=64, rope_is_neox=False,
                         hidden_size=128, intermediate_size=96, vocab_size=300, block_size=16)

    def neox_always(query, key, cos_sin, is_neox):
        return rotary_embedding(query, key, cos_sin, True)

    wrong = {"rotary_cos_sin": rotary_cos_sin, "rotary_embedding": neox_always}
    assert probe_rotary(wrong, shapes, ProbeInputs(CPU, torch.float32)) > 0.1


def test_an_odd_rotary_dim_is_declined_with_its_reason() -> None:
    shapes = ModelShapes(num_heads=8, num_kv_heads=2, head_dim=64, rotary_dim=33, rope_is_neox=True,
                         hidden_size=128, intermediate_size=96, vocab_size=300, block_size=16)
    assert unsupported("rotary", shapes, torch.float16) == "rotary_dim 33 unsupported (odd: its dims cannot pair up)"
