"""One check per op: run a candidate on the worker's device, in the model's dtype, on random inputs
shaped like the model's, and measure how far it lands from the reference.

The reference runs on the same inputs in float32 (on the host), so the error is the candidate's
own. Inputs cover what a step can hold: GQA, the model's head dim and block size, contexts that
cross block boundaries, a prefill after a cached prefix (chunked prefill), a batch without a decode
part, the fused residual add of RMSNorm, partial and interleaved rotary, the model's sliding window
(both with and without it: some layers of a model may have none) with contexts that cross its edge,
and for mixture-of-experts models the model's routing with experts that receive no token. Some ops'
probes have files of their own (linear, MLA, quantized, LoRA).
"""

from collections.abc import Callable

import numpy as np
import torch

from xinserve.kernels import kv_quant
from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes import linear as linear_probes
from xinserve.kernels.probes import lora as lora_probes
from xinserve.kernels.probes import mla as mla_probes
from xinserve.kernels.probes import quant as quant_probes
from xinserve.kernels.probes.inputs import (
    ProbeInputs,
    max_error,
    pool_size,
    scrambled_block_tables,
    to_host32,
)
from xinserve.kernels.references import dense as reference

# Largest tolerated max-abs error against the float32 reference, for inputs of order one.
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
# A KV cache write may round a token to a neighbouring stored value (an 8-bit code computed on the device
# rounds its own way): about one step of the kind for inputs of order one (int8: absmax / 127; e4m3: 3
# mantissa bits, 0.25 just below 4).
WRITE_TOLERANCE = {torch.int8: 3e-2, torch.float8_e4m3fn: 2.5e-1}


def probe_tolerance(op: str, shapes: ModelShapes, dtype: torch.dtype) -> float:
    """The largest error a candidate for ``op`` may show: the model dtype's, or the KV cache dtype's where
    a kernel may compute in it (a float32 model's attention over a bfloat16 cache reads bfloat16 queries)."""
    tolerance = TOLERANCE[dtype]
    kv = shapes.kv_cache_dtype
    if op in ("write_kv", "prefill_attention", "decode_attention") and kv is not None:
        tolerance = max(tolerance, TOLERANCE.get(kv, 0.0))
        if op == "write_kv":
            tolerance = max(tolerance, WRITE_TOLERANCE.get(kv, 0.0))
    return tolerance


def applies(op: str, shapes: ModelShapes) -> bool:
    """Whether a model of these shapes calls ``op`` at all (a dense model never calls fused_moe, only
    MLA models call the latent ops and never the per-head KV ones, only DSA models the indexer)."""
    if op in ("write_kv", "prefill_attention", "decode_attention"):
        return shapes.kv_lora_rank == 0
    if op == "fused_moe":
        return shapes.num_experts > 0
    if op in ("write_latent", "mla_decode_attention", "mla_prefill_attention"):
        return shapes.kv_lora_rank > 0
    if op == "indexer_topk":
        return shapes.index_topk > 0
    if op == "quant_linear":
        return any(not shape.experts for shape in shapes.quant_shapes)
    if op == "quant_fused_moe":
        return any(shape.experts for shape in shapes.quant_shapes)
    if op == "lora":
        return shapes.max_lora_rank > 0
    return True


def _paged_cache(x: ProbeInputs, shapes: ModelShapes, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    # key_cache, value_cache: [N, BS, KVH, D (+ 4)] in the KV cache's dtype (kernels/kv_quant.py)
    shape = (num_blocks, shapes.block_size, shapes.num_kv_heads, shapes.head_dim)
    dtype = shapes.kv_cache_dtype or x.dtype
    return tuple(kv_quant.quantize(x.randn(*shape, dtype=torch.float32), dtype) for _ in range(2))


def probe_write_kv(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    num_blocks, bs = 4, shapes.block_size
    key_cache, value_cache = _paged_cache(x, shapes, num_blocks)
    # Slots scattered over every block, both ends of a block included.
    slots = torch.tensor([0, bs - 1, bs, 2 * bs + 3, 4 * bs - 1], dtype=torch.int64, device=x.device)
    key = x.randn(len(slots), shapes.num_kv_heads, shapes.head_dim)
    value = x.randn(len(slots), shapes.num_kv_heads, shapes.head_dim)
    got_k, got_v = key_cache.clone(), value_cache.clone()
    fn["write_kv"](key, value, got_k, got_v, slots)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reference.write_kv(key, value, want_k, want_v, slots)
    # compared as the values they hold (an 8-bit row's codes times its scale)
    return max_error(*(tuple(kv_quant.dequantize(c, shapes.head_dim, torch.float32) for c in pair)
                       for pair in ((got_k, got_v), (want_k, want_v))))


def _windows(shapes: ModelShapes) -> list[dict[str, int]]:
    """The attention calls to probe: without a window, and with the model's window when it has one
    (passed as a keyword, as the model passes it on windowed layers only)."""
    window = shapes.sliding_window
    return [{}] if window is None else [{}, {"sliding_window": window}]


def probe_prefill_attention(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    bs = shapes.block_size
    # A whole 7-token prompt, then a 5-token chunk after a cached prefix that ends mid-block (and
    # reaches past the model's window, whose edge then cuts into the prefix).
    q_lens, seq_lens = [7, 5], [7, max(bs, shapes.sliding_window or 0) + 8]
    num_blocks = pool_size(seq_lens, bs)
    key_cache, value_cache = _paged_cache(x, shapes, num_blocks)
    tables = torch.from_numpy(scrambled_block_tables(seq_lens, bs, num_blocks, seed=1)).to(x.device)
    query = x.randn(sum(q_lens), shapes.num_heads, shapes.head_dim)
    query_start_loc = [0, q_lens[0], sum(q_lens)]
    scale = shapes.head_dim**-0.5
    args = [to_host32(a) for a in (query, key_cache, value_cache, tables)]
    errors = []
    for window in _windows(shapes):
        got = fn["paged_prefill_attention"](query, key_cache, value_cache, tables, query_start_loc, seq_lens,
                                            scale, **window)
        want = reference.paged_prefill_attention(*args, query_start_loc, seq_lens, scale, **window)
        errors.append(max_error(got, want))
    return max(errors)


def probe_decode_attention(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    bs = shapes.block_size
    # one token, just past a block, deep into the third block (and 3 tokens past the window)
    lens = [1, bs + 1, max(2 * bs, shapes.sliding_window or 0) + 3]
    num_blocks = pool_size(lens, bs)
    key_cache, value_cache = _paged_cache(x, shapes, num_blocks)
    tables_np = scrambled_block_tables(lens, bs, num_blocks, seed=2)
    lens_np = np.array(lens, np.int32)
    tables = torch.from_numpy(tables_np).to(x.device)
    seq_lens = torch.from_numpy(lens_np).to(x.device)
    query = x.randn(len(lens), shapes.num_heads, shapes.head_dim)
    scale = shapes.head_dim**-0.5
    gather = build_decode_gather(tables_np, lens_np, bs, x.device)
    host_gather = build_decode_gather(tables_np, lens_np, bs, torch.device("cpu"))
    args = [to_host32(a) for a in (query, key_cache, value_cache, tables, seq_lens)]
    errors = []
    for window in _windows(shapes):
        got = fn["paged_decode_attention"](query, key_cache, value_cache, tables, seq_lens, scale, gather, **window)
        want = reference.paged_decode_attention(*args, scale, host_gather, **window)
        errors.append(max_error(got, want))
    return max(errors)


def probe_rms_norm(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    errors = []
    for size in {shapes.hidden_size, shapes.head_dim}:  # the layer norms and Qwen3's per-head q/k norm
        hidden, residual = x.randn(5, size), x.randn(5, size)
        weight = 1 + 0.1 * x.randn(size)
        eps = shapes.rms_norm_eps
        errors.append(max_error(fn["rms_norm"](hidden, weight, eps),
                                reference.rms_norm(*map(to_host32, (hidden, weight)), eps)))
        got = fn["rms_norm"](hidden, weight, eps, residual)
        want = reference.rms_norm(*map(to_host32, (hidden, weight)), eps, to_host32(residual))
        errors.append(max_error(got, want))
    return max(errors)


def probe_rotary(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    positions = torch.tensor([0, 1, 17, 130, 511], dtype=torch.int64)
    half = shapes.rotary_dim // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.arange(512, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [512, rotary_dim]
    query = x.randn(len(positions), shapes.num_heads, shapes.head_dim)
    key = x.randn(len(positions), shapes.num_kv_heads, shapes.head_dim)
    is_neox = shapes.rope_is_neox
    table = fn["rotary_cos_sin"](positions.to(x.device), cache.to(x.device), is_neox, x.dtype)
    got = fn["rotary_embedding"](query, key, table, is_neox)
    want_table = reference.rotary_cos_sin(positions, cache, is_neox, torch.float32)
    want = reference.rotary_embedding(to_host32(query), to_host32(key), want_table, is_neox)
    return max_error(got, want)


def probe_silu_and_mul(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    gate_up = x.randn(5, 2 * shapes.intermediate_size)
    return max_error(fn["silu_and_mul"](gate_up), reference.silu_and_mul(to_host32(gate_up)))


def probe_fused_moe(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    # The model's experts and routing, with one expert's matrices cut to at most 256 x 128: a real
    # model's full expert stack would cost gigabytes here, and a matmul's accuracy does not depend
    # on its size. 7 tokens leave some experts without a row; a lone token is a decode step.
    routing, num_experts = shapes.moe_routing, shapes.num_experts
    hidden_size, inter = min(shapes.hidden_size, 256), min(shapes.moe_intermediate_size, 128)
    # weights scaled so that every intermediate value stays of order one
    w13 = x.randn(num_experts, 2 * inter, hidden_size) * hidden_size**-0.5
    w2 = x.randn(num_experts, hidden_size, inter) * inter**-0.5
    bias = 0.1 * x.randn(num_experts, dtype=torch.float32) if routing.correction_bias else None
    errors = []
    for tokens in (7, 1):
        hidden = x.randn(tokens, hidden_size)
        logits = x.randn(tokens, num_experts, dtype=torch.float32)
        weights, ids = fn["select_experts"](logits, routing, bias)
        got = fn["fused_moe"](hidden, w13, w2, weights, ids)
        want_weights, want_ids = reference.select_experts(logits.cpu(), routing, to_host32(bias))
        want = reference.fused_moe(*map(to_host32, (hidden, w13, w2)), want_weights, want_ids)
        errors.append(max_error(got, want))
    return max(errors)


def _distinct_logits(x: ProbeInputs, rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, V] float32 on the device: 3 x the V normal quantiles, shuffled per row (all distinct)."""
    quantiles = torch.special.ndtri((torch.arange(vocab_size, dtype=torch.float64) + 0.5) / vocab_size)
    order = torch.stack([torch.randperm(vocab_size, generator=x.generator) for _ in range(rows)])
    return (3 * quantiles[order]).float().to(x.device)


def probe_top_k_top_p(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    # Logits are float32 in the sampler whatever the model's dtype. No two in a row are equal: where the
    # reference's top-p cut falls inside a group of equal logits, which of them its sort keeps is an
    # accident of the sort (a vocabulary of 150k normal float32 samples holds ~100 equal pairs), and
    # a candidate that keeps the whole group (kernels/triton/sampling.py) must not fail on that.
    logits = _distinct_logits(x, 4, shapes.vocab_size)
    top_k = torch.tensor([[0], [5], [1], [min(50, shapes.vocab_size)]], dtype=torch.int64)
    top_p = torch.tensor([[1.0], [0.9], [0.5], [0.8]], dtype=torch.float32)
    got = fn["top_k_top_p"](logits, top_k.to(x.device), top_p.to(x.device))
    return max_error(got, reference.top_k_top_p(logits.cpu(), top_k, top_p))


PROBES: dict[str, Callable[[dict[str, Callable], ModelShapes, ProbeInputs], float]] = {
    "write_kv": probe_write_kv,
    "prefill_attention": probe_prefill_attention,
    "decode_attention": probe_decode_attention,
    "rms_norm": probe_rms_norm,
    "rotary": probe_rotary,
    "silu_and_mul": probe_silu_and_mul,
    "fused_moe": probe_fused_moe,
    "top_k_top_p": probe_top_k_top_p,
    **mla_probes.PROBES,
    **quant_probes.PROBES,
    **linear_probes.PROBES,
    **lora_probes.PROBES,
}


def probe(op: str, functions: dict[str, Callable], shapes: ModelShapes, device: torch.device,
          dtype: torch.dtype) -> float:
    """Max abs error of ``functions`` (the op's candidate functions) against the reference."""
    with torch.inference_mode():
        return PROBES[op](functions, shapes, ProbeInputs(device, dtype))
