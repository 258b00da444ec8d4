"""The fused elementwise Triton kernels on a CUDA GPU (kernels/triton/norm.py, rotary.py, activation.py,
sampling.py), one check per kernel for tests/gpu/check_cuda.py: correct against the float32 reference in
bf16 / fp16 / fp32 at Llama-3-8B shapes and 1, 33 and 256 tokens; captured in a CUDA graph and replayed on
new inputs (no host sync, no value-dependent allocation: the capture would fail or the replay differ); and
timed against the reference in bf16 at decode batches 1, 32 and 128 (L2 flushed before each call).
Inputs are scaled so that results stay below 4 over a million samples (the weights of the norm about 0.5,
activations about N(0, 0.25)): the registry's tolerances are for results of order one, and a 16-bit
result of 5 to 8 is a rounding step of 0.03 away from its float32 value.

Each check returns {"rows": [...], "timing": [...], "ok": bool}; ``render`` prints them."""

from collections.abc import Callable

import torch

from xinserve.kernels.probes.checks import TOLERANCE
from xinserve.kernels.probes.inputs import max_error
from xinserve.kernels.references import dense as reference
from xinserve.kernels.triton import OPS as TRITON

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4096, 32, 8, 128, 14336, 128256  # Llama-3-8B
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TOKENS = (1, 33, 256)
TIMED_BATCHES = (1, 32, 128)

# An op's case: (triton function, reference function, inputs(tokens, dtype, device) -> args)
Case = tuple[Callable, Callable, Callable[[int, torch.dtype, torch.device], tuple]]


def _rms_norm_inputs(tokens: int, dtype: torch.dtype, device: torch.device) -> tuple:
    x, residual = (torch.randn(tokens, HIDDEN, device=device, dtype=dtype) for _ in range(2))
    return x, (0.5 + 0.05 * torch.randn(HIDDEN, device=device)).to(dtype), 1e-5, residual


def _rotary_inputs(tokens: int, dtype: torch.dtype, device: torch.device) -> tuple:
    # query / key: views of one fused qkv projection, as the model passes them
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = (0.5 * torch.randn(tokens, q_size + 2 * kv_size, device=device)).to(dtype)
    half = HEAD_DIM // 2
    inv_freq = 1.0 / (500000.0 ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    angles = torch.arange(8192, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    table = TRITON["rotary_cos_sin"](positions, cache, True, dtype)
    return (qkv[:, :q_size].view(tokens, HEADS, HEAD_DIM),
            qkv[:, q_size : q_size + kv_size].view(tokens, KV_HEADS, HEAD_DIM), table, True)


def _silu_inputs(tokens: int, dtype: torch.dtype, device: torch.device) -> tuple:
    return ((0.5 * torch.randn(tokens, 2 * INTER, device=device)).to(dtype),)


def _sampling_inputs(tokens: int, dtype: torch.dtype, device: torch.device) -> tuple:
    # float32 logits whatever the model's dtype: 3 x the normal quantiles, shuffled per row (distinct: the
    # reference breaks top-p ties by its sort order). Rows of mixed settings: keep all, k = 1, k = 50 with
    # p = 0.9, p = 0.5 alone. A cut at 0.5 falls among tokens of probability ~6e-4, far above what float32
    # sums over the vocabulary err by (a cut at 0.8 or 0.9 alone would fall among ~1e-5: a coin toss
    # between two correct sums); the reference runs in float64.
    quantiles = torch.special.ndtri((torch.arange(VOCAB, device=device, dtype=torch.float64) + 0.5) / VOCAB)
    logits = (3 * quantiles[torch.stack([torch.randperm(VOCAB, device=device) for _ in range(tokens)])]).float()
    rows = torch.arange(tokens, device=device)[:, None] % 4
    top_k = torch.tensor([0, 1, 50, 0], device=device)[rows]
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5], device=device)[rows]
    return logits, top_k, top_p


CASES: dict[str, Case] = {
    "rms_norm": (TRITON["rms_norm"], reference.rms_norm, _rms_norm_inputs),
    "rotary": (TRITON["rotary_embedding"], reference.rotary_embedding, _rotary_inputs),
    "silu_and_mul": (TRITON["silu_and_mul"], reference.silu_and_mul, _silu_inputs),
    "top_k_top_p": (TRITON["top_k_top_p"], reference.top_k_top_p, _sampling_inputs),
}


def _widened(args: tuple, dtype: torch.dtype) -> tuple:
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _replays(fn: Callable, make: Callable, tokens: int, device: torch.device) -> bool:
    """fn captured in a CUDA graph, its inputs overwritten with new values, replayed: equal to eager."""
    args = make(tokens, torch.bfloat16, device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernel before the capture
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    fresh = make(tokens, torch.bfloat16, device)
    for static, new in zip(args, fresh):
        if isinstance(static, torch.Tensor):
            static.copy_(new)
    graph.replay()
    return max_error(out, fn(*args)) == 0.0


def check_fused_op(name: str, device: torch.device, cuda_ms: Callable[..., float]) -> dict:
    """One fused kernel: correctness per dtype and token count, graph replay, bf16 timing vs the reference."""
    fn, ref, make = CASES[name]
    rows = []
    for dtype in DTYPES:
        for tokens in TOKENS:
            torch.manual_seed(tokens)
            args = make(tokens, dtype, device)
            # top-k / top-p keeps logits as they are or -inf: exact, against a float64 reference; the others
            # within the registry's tolerance of a float32 one
            exact = name == "top_k_top_p"
            tolerance = 0.0 if exact else TOLERANCE[dtype]
            error = max_error(fn(*args), ref(*_widened(args, torch.float64 if exact else torch.float32)))
            rows.append({"op": name, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                         "max_abs_err": error, "tolerance": tolerance, "ok": error <= tolerance})
    replayed = _replays(fn, make, 32, device)
    timing = []
    for batch in TIMED_BATCHES:
        args = make(batch, torch.bfloat16, device)
        triton_ms, reference_ms = cuda_ms(fn, *args), cuda_ms(ref, *args)
        timing.append({"op": name, "batch": batch, "triton_ms": triton_ms, "reference_ms": reference_ms,
                       "speedup": reference_ms / triton_ms})
    return {"rows": rows, "graph_replay_equal": replayed, "timing": timing,
            "ok": replayed and all(row["ok"] for row in rows)}


def render(results: dict[str, dict]) -> list[str]:
    lines = ["", "fused Triton ops (Llama-3-8B shapes) against the reference; timing bf16, L2 flushed:", "",
             "| op | worst err / tol (dtype, tokens) | graph replay | batch: triton ms / reference ms |",
             "|---|---|---|---|"]
    for name, result in results.items():
        worst = max(result["rows"], key=lambda r: r["max_abs_err"] / max(r["tolerance"], 1e-30))
        timing = ", ".join(f"{t['batch']}: {t['triton_ms']:.3f} / {t['reference_ms']:.3f}" for t in result["timing"])
        lines.append(f"| {name} | {worst['max_abs_err']:.1e} / {worst['tolerance']:.0e} ({worst['dtype']}, "
                     f"{worst['tokens']}) | {'equal' if result['graph_replay_equal'] else 'DIFFERS'} | {timing} |")
    return lines
