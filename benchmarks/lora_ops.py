"""Multi-LoRA's ops against the base linear layers they ride on: what serving adapters adds to a layer.

One transformer layer's four adapted projections (fused q/k/v, o_proj, fused gate/up, down_proj) of a
Qwen2.5-0.5B-shaped model (hidden 896, 14 heads / 2 KV heads of 64, intermediate 4864; ``--quick``: a
tiny one), with random weights: per point, the fastest of ``--repeats`` timings (on a shared machine the
least disturbed estimate) of the four base ``F.linear`` calls and of the LoRA ops on the same rows
(``lora_shrink`` then ``lora_expand`` per projection, q/k/v and gate/up with their slices' ranks stacked:
3x and 2x ``--rank``). Points: decode batches 1, 8, 32 and a prefill of
512 tokens; the rows' slots cycle over the ``--slots`` adapters and the base model (-1), as a batch
mixing adapted and plain requests. ``overhead`` is the LoRA ops' time over the base linears' (the
layer's attention and norms left out: the ops alone). ``--impl`` picks the implementation the kernel
registry names (kernels/registry.py's MODULES): ``reference`` by default (the pure-torch ops, what a
CPU or Ascend bfloat16 worker runs), ``triton`` on a GPU. Prints a markdown table and writes
``benchmarks/results/lora_ops.json``. The committed result (CPU, float32, one thread):

    python benchmarks/lora_ops.py --repeats 15

Smoke run: ``python benchmarks/lora_ops.py --quick --out /tmp/lora_ops.json``.
"""

import importlib
import os
import time

from common import lscpu, markdown_table, script_args, write_result

# (hidden, heads, KV heads, head dim, intermediate)
SHAPES = {"qwen2.5-0.5b": (896, 14, 2, 64, 4864), "tiny": (64, 4, 2, 16, 128)}
DECODE_BATCHES = (1, 8, 32)


def projections(shape: tuple[int, ...], rank: int) -> list[tuple[str, int, int, int]]:
    """(name, in, out, stacked rank) of one layer's adapted projections."""
    hidden, heads, kv_heads, head_dim, inter = shape
    q, kv = heads * head_dim, kv_heads * head_dim
    return [("qkv_proj", hidden, q + 2 * kv, 3 * rank), ("o_proj", q, hidden, rank),
            ("gate_up_proj", hidden, 2 * inter, 2 * rank), ("down_proj", inter, hidden, rank)]


def best_ms(run, device, repeats: int) -> float:
    """The fastest of ``repeats`` timings of ``run()`` in milliseconds, after one warm-up call (device work
    waited for)."""
    import torch

    backend = getattr(torch, device.type, None)
    sync = backend.synchronize if device.type != "cpu" and hasattr(backend, "synchronize") else lambda: None
    run()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def measure_point(tokens: int, layer: list[dict], ops: dict, num_slots: int, device, dtype, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(tokens)
    slots = (torch.arange(tokens) % (num_slots + 1) - 1).to(device)  # base rows and every adapter in turn
    inputs = [torch.randn(tokens, p["weight"].shape[1], generator=generator).to(device, dtype) for p in layer]
    outputs = [torch.zeros(tokens, p["weight"].shape[0], device=device, dtype=dtype) for p in layer]
    shrunk = [ops["lora_shrink"](x, p["a_stack"], slots) for x, p in zip(inputs, layer, strict=True)]

    def base() -> None:
        for x, p in zip(inputs, layer, strict=True):
            F.linear(x, p["weight"])

    def shrink() -> None:
        for x, p in zip(inputs, layer, strict=True):
            ops["lora_shrink"](x, p["a_stack"], slots)

    def expand() -> None:
        for h, out, p in zip(shrunk, outputs, layer, strict=True):
            ops["lora_expand"](out, h, p["b_stack"], slots)

    with torch.inference_mode():
        base_ms, shrink_ms, expand_ms = (best_ms(run, device, repeats) for run in (base, shrink, expand))
    lora_ms = shrink_ms + expand_ms
    return {"phase": "decode" if tokens in DECODE_BATCHES else "prefill", "tokens": tokens,
            "base_linear_ms": round(base_ms, 4), "lora_shrink_ms": round(shrink_ms, 4),
            "lora_expand_ms": round(expand_ms, 4), "lora_ms": round(lora_ms, 4), "overhead": round(lora_ms / base_ms, 4)}


def main() -> None:
    parser = script_args(__doc__, "lora_ops.json", "a tiny model shape and fewer repeats (a smoke run)")
    parser.add_argument("--impl", default="reference", help="the registry's implementation name (reference, triton)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--rank", type=int, default=16, help="max_lora_rank")
    parser.add_argument("--slots", type=int, default=4, help="max_loras: adapter slots on the device")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    import torch

    from xinserve.kernels.registry import MODULES

    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ops = importlib.import_module(MODULES[args.impl]).OPS
    model = "tiny" if args.quick else "qwen2.5-0.5b"
    repeats = 3 if args.quick else args.repeats
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * fan_in**-0.5).to(device, dtype)

    layer = [{"name": name, "weight": weight(n_out, n_in, fan_in=n_in), "a_stack": weight(args.slots, r, n_in, fan_in=n_in),
              "b_stack": weight(args.slots, n_out, r, fan_in=r)} for name, n_in, n_out, r in projections(SHAPES[model], args.rank)]
    rows = [measure_point(tokens, layer, ops, args.slots, device, dtype, repeats)
            for tokens in (*DECODE_BATCHES, args.prefill_tokens)]
    print(markdown_table(["phase", "tokens", "base linear ms", "shrink ms", "expand ms", "LoRA ms", "overhead"],
                         [[r["phase"], r["tokens"], r["base_linear_ms"], r["lora_shrink_ms"], r["lora_expand_ms"],
                           r["lora_ms"], f"{r['overhead']:.1%}"] for r in rows]))
    write_result(args.out, {
        "impl": args.impl, "device": args.device, "dtype": args.dtype, "threads": args.threads, "model": model,
        "shape": dict(zip(("hidden", "heads", "kv_heads", "head_dim", "intermediate"), SHAPES[model], strict=True)),
        "projections": [p["name"] for p in layer], "max_lora_rank": args.rank, "max_loras": args.slots,
        "repeats": repeats, "torch": torch.__version__, "lscpu": {k: v for k, v in lscpu().items() if k != "Flags"},
        "load_average": os.getloadavg(), "rows": rows,
    })


if __name__ == "__main__":
    main()
