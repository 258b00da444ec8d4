"""One prepared run on a CUDA GPU: the kernel registry's choice on this GPU, the Triton kernels
against the references at realistic shapes, greedy generation on the GPU against transformers, then
decode attention timed against the reference, then decode with CUDA graphs per bucket against
eager (tokens, replays without allocation or host sync, decode-only step time per bucket), then each
fused elementwise Triton kernel (RMSNorm, rotary, SiLU-and-mul, top-k / top-p) checked, replayed from a
CUDA graph and timed against the reference (tests/gpu/fused_checks.py). Prints a table, writes
benchmarks/results/cuda_check.json, and exits 1 when a kernel or the generation disagrees (2 when
there is no CUDA GPU). Runs in well under five minutes on one GPU.

    python tests/gpu/check_cuda.py

``main()`` calls one function per check, each returning a JSON-ready result; a new check is one
more function and one more line there. Not a pytest test: pytest collects only ``test_*.py``.
"""

import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]  # this checkout's packages, graph_buckets.py

import fused_checks  # tests/gpu/fused_checks.py, on the path above

from xinserve.engines.platforms.cuda import KERNEL_PREFERENCE as CUDA_KERNELS
from xinserve.kernels import triton as triton_ops
from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.probes.checks import TOLERANCE  # the registry's, so a pass here is a pass there
from xinserve.kernels.references import dense as reference
from xinserve.kernels.triton.decode_attention import default_num_splits

RESULTS = ROOT / "benchmarks" / "results" / "cuda_check.json"
# A Llama-3-70B layer: GQA 8:1, head dim 128; the usual CUDA block size.
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 64, 8, 128, 16
CHECK_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# decode contexts: one token, both sides of a block boundary, long enough to split, the longest
DECODE_LENS = [1, 15, 16, 17, 1000, 4097, 8191, 8192]
# prefill: a whole prompt, a chunk after a cached prefix, one token after 8191, a chunk mid-block
PREFILL_Q_LENS, PREFILL_SEQ_LENS = [1000, 512, 1, 77], [1000, 3512, 8192, 8000]
BENCH_BATCHES, BENCH_CONTEXTS = (1, 8, 32, 64), (512, 2048, 8192)
BENCH_ITERS = 20


def block_tables(seq_lens: list[int], num_blocks: int, seed: int) -> np.ndarray:
    """[S, B] int32 tables of distinct blocks drawn from a shuffled pool of num_blocks."""
    needed = [-(-n // BLOCK_SIZE) for n in seq_lens]
    order = np.random.default_rng(seed).permutation(num_blocks)[: sum(needed)]
    table, start = np.zeros((len(seq_lens), max(needed)), np.int32), 0
    for i, n in enumerate(needed):
        table[i, :n] = order[start : start + n]
        start += n
    return table


def random_cache(num_blocks: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """key_cache, value_cache: [N, BS, KVH, D]."""
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)


def max_abs_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max())


def environment(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    return {
        "device": props.name,
        "capability": f"sm_{props.major}{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
    }


def check_kernels(device: torch.device) -> list[dict]:
    """Each Triton op against the reference, per dtype, at the shapes above. The reference runs in
    float32 on the same (rounded) inputs, so the error is the kernel's own."""
    rows = []
    for dtype in CHECK_DTYPES:
        torch.manual_seed(0)
        tolerance = TOLERANCE[dtype]

        num_blocks = sum(-(-n // BLOCK_SIZE) for n in DECODE_LENS) + 8
        key_cache, value_cache = random_cache(num_blocks, dtype, device)
        tables_np = block_tables(DECODE_LENS, num_blocks, seed=1)
        lens_np = np.array(DECODE_LENS, np.int32)
        tables, lens = torch.from_numpy(tables_np).to(device), torch.from_numpy(lens_np).to(device)
        query = torch.randn(len(DECODE_LENS), HEADS, HEAD_DIM, device=device, dtype=dtype)
        scale = HEAD_DIM**-0.5
        gather = build_decode_gather(tables_np, lens_np, BLOCK_SIZE, device)
        want = reference.paged_decode_attention(
            query.float(), key_cache.float(), value_cache.float(), tables, lens, scale, gather
        )
        max_len = tables_np.shape[1] * BLOCK_SIZE
        # the default (each context cut by its own length into the table's split count), then one split
        for split_len in (None, max_len):
            got = triton_ops.paged_decode_attention(
                query, key_cache, value_cache, tables, lens, scale, split_len=split_len
            )
            splits = default_num_splits(max_len, len(DECODE_LENS), KV_HEADS) if split_len is None else 1
            case = f"lens {DECODE_LENS}, {splits} split{'s' if splits > 1 else ''}"
            rows.append(_row("decode_attention", dtype, case, max_abs_err(got, want), tolerance))

        num_blocks = sum(-(-n // BLOCK_SIZE) for n in PREFILL_SEQ_LENS) + 8
        key_cache, value_cache = random_cache(num_blocks, dtype, device)
        tables = torch.from_numpy(block_tables(PREFILL_SEQ_LENS, num_blocks, seed=2)).to(device)
        query = torch.randn(sum(PREFILL_Q_LENS), HEADS, HEAD_DIM, device=device, dtype=dtype)
        query_start_loc = np.concatenate(([0], np.cumsum(PREFILL_Q_LENS))).tolist()
        got = triton_ops.paged_prefill_attention(
            query, key_cache, value_cache, tables, query_start_loc, PREFILL_SEQ_LENS, scale
        )
        want = reference.paged_prefill_attention(
            query.float(), key_cache.float(), value_cache.float(), tables, query_start_loc, PREFILL_SEQ_LENS,
            scale,
        )
        case = f"q_lens {PREFILL_Q_LENS} seq_lens {PREFILL_SEQ_LENS}"
        rows.append(_row("prefill_attention", dtype, case, max_abs_err(got, want), tolerance))

        # keys and values as the model makes them: slices of one fused projection (not contiguous)
        kv = torch.randn(300, 2, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:300]
        got_caches = (key_cache.clone(), value_cache.clone())
        triton_ops.write_kv(kv[:, 0], kv[:, 1], *got_caches, slots)
        reference.write_kv(kv[:, 0], kv[:, 1], key_cache, value_cache, slots)
        error = max(max_abs_err(got_caches[0], key_cache), max_abs_err(got_caches[1], value_cache))
        rows.append(_row("write_kv", dtype, "300 scattered slots", error, 0.0))
    return rows


def _row(op: str, dtype: torch.dtype, case: str, error: float, tolerance: float) -> dict:
    # `error <= tolerance` is False for NaN, so a NaN fails
    return {"op": op, "dtype": str(dtype).removeprefix("torch."), "case": case, "max_abs_err": error,
            "tolerance": tolerance, "ok": error <= tolerance}


def time_decode(device: torch.device) -> list[dict]:
    """Decode attention in bf16, Triton against the reference, at every batch and context; the
    reference's gather plan is built once per step in the engine, so it is built outside the timing."""
    torch.manual_seed(0)
    dtype = torch.bfloat16
    num_blocks = max(BENCH_BATCHES) * max(BENCH_CONTEXTS) // BLOCK_SIZE
    key_cache, value_cache = random_cache(num_blocks, dtype, device)
    scale = HEAD_DIM**-0.5
    rows = []
    for batch in BENCH_BATCHES:
        for context in BENCH_CONTEXTS:
            lens_np = np.full(batch, context, np.int32)
            tables_np = block_tables(lens_np.tolist(), num_blocks, seed=batch)
            tables, lens = torch.from_numpy(tables_np).to(device), torch.from_numpy(lens_np).to(device)
            query = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=dtype)
            gather = build_decode_gather(tables_np, lens_np, BLOCK_SIZE, device)
            args = (query, key_cache, value_cache, tables, lens, scale)
            triton_ms = cuda_ms(triton_ops.paged_decode_attention, *args)
            reference_ms = cuda_ms(reference.paged_decode_attention, *args, gather)
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize
            rows.append({
                "batch": batch, "context": context,
                "splits": default_num_splits(tables_np.shape[1] * BLOCK_SIZE, batch, KV_HEADS),
                "triton_ms": triton_ms, "reference_ms": reference_ms, "speedup": reference_ms / triton_ms,
                "triton_kv_gbps": kv_bytes / triton_ms / 1e6,
            })
    return rows


def probe_registry(device: torch.device) -> dict:
    """What a worker on this GPU would choose for a Llama-3-70B-shaped layer in bf16, and why."""
    from xinserve.kernels.model_shapes import ModelShapes
    from xinserve.kernels.registry import select

    shapes = ModelShapes(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rotary_dim=HEAD_DIM,
                         rope_is_neox=True, hidden_size=8192, intermediate_size=28672, vocab_size=128256,
                         block_size=BLOCK_SIZE, max_lora_rank=16, max_loras=4)
    return select(CUDA_KERNELS, device, torch.bfloat16, shapes).report()


def lora_graphs(device: torch.device) -> dict:
    """The Triton LoRA ops (both kernels: 8 rows per-row bgmv, 96 rows grouped by slot) captured in a CUDA
    graph, replayed after the slots changed in place: equal to the reference on the new slots, base-model
    rows untouched (the capture froze nothing but the shapes: the slot sort runs on the device)."""
    from xinserve.kernels.references import lora as lora_reference
    from xinserve.kernels.triton import lora as triton_lora

    gen = torch.Generator().manual_seed(0)
    slots_count, rank, n_in, n_out = 4, 48, 4096, 6144  # a Llama-3-8B q/k/v at rank 16

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, torch.bfloat16)

    a_stack, b_stack = randn(slots_count, rank, n_in, scale=0.5 * n_in**-0.5), randn(slots_count, n_out, rank, scale=0.5 * rank**-0.5)
    rows = []
    for count in (8, 96):
        x, before = randn(count, n_in), randn(count, n_out, scale=0.5)
        slots, out = torch.randint(-1, slots_count, (count,), generator=gen).to(device), before.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the kernels before the capture
            triton_lora.lora_expand(out, triton_lora.lora_shrink(x, a_stack, slots), b_stack, slots)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            triton_lora.lora_expand(out, triton_lora.lora_shrink(x, a_stack, slots), b_stack, slots)
        for _ in range(3):
            slots.copy_(torch.randint(-1, slots_count, (count,), generator=gen))
            out.copy_(before)
            graph.replay()
            host = slots.cpu()
            h = lora_reference.lora_shrink(x.float().cpu(), a_stack.float().cpu(), host)
            want = lora_reference.lora_expand(before.float().cpu(), h, b_stack.float().cpu(), host)
            base = host < 0
            rows.append({"rows": count, "max_abs_err": max_abs_err(out.cpu(), want),
                         "base_rows_untouched": torch.equal(out.cpu()[base], before.cpu()[base])})
    ok = all(r["max_abs_err"] <= TOLERANCE[torch.bfloat16] and r["base_rows_untouched"] for r in rows)
    return {"rows": rows, "ok": ok}


def greedy_vs_transformers(device: torch.device) -> dict:
    """Greedy tokens of the engine on this GPU (registry's kernels, fp32) equal transformers'."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from xinserve.engines import LLM, SamplingParams
    from xinserve.server.embedded_model.factory import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(tmp, "llama", hidden_size=256, num_heads=8, num_kv_heads=2, num_layers=2)
        llm = LLM(str(path), device="cuda:0", dtype="float32", num_kv_blocks=512, max_num_batched_tokens=64)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 900, size=n).tolist() for n in (5, 40, 130, 300)]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        ours = [out.token_ids for out in llm.generate(prompts, params)]
        theirs = []
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=24, min_new_tokens=24,
                              do_sample=False, top_p=None, top_k=None, temperature=None)
            theirs.append(out[0, len(prompt):].tolist())
        kernels = llm.engine.runner.kernels.chosen
    equal = [a == b for a, b in zip(ours, theirs)]
    return {"prompts": len(prompts), "equal": sum(equal), "ok": all(equal), "kernels": kernels}


def cuda_graphs(device: torch.device) -> dict:
    """Decode with CUDA graphs per bucket (engines/worker/graphs.py) against eager: greedy tokens equal at
    batches 1, 3, 8 and 9 (bucket boundaries); every captured bucket replays without allocating or syncing
    the host (graph_buckets.replay_check); and decode-only ms/step per bucket, graphs and eager, at its own
    batch and one that pads into it, each engine warmed at that batch first and the order alternating
    (issue 42's slow bucket 4 was a Triton compile charged to whichever engine met a batch first, the
    whole generate timed, prefill included)."""
    import tempfile

    from graph_buckets import bucket_rows, replay_check

    from xinserve.engines import LLM, SamplingParams
    from xinserve.server.embedded_model.factory import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_model(tmp, "llama", hidden_size=256, num_heads=4, num_kv_heads=2, num_layers=4))
        engines = {mode: LLM(path, device="cuda:0", dtype="float32", num_kv_blocks=1024, max_num_seqs=32,
                             compile=mode) for mode in ("on", "off")}
        graphs = engines["on"].engine.runner.decode_graphs
        captured = sorted(graphs.steps)
        rng = np.random.default_rng(1)
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        for batch in (1, 3, 8, 9, 32):
            prompts = [rng.integers(3, 900, size=int(n)).tolist() for n in rng.integers(20, 200, size=batch)]
            tokens = {mode: [out.token_ids for out in llm.generate(prompts, params)] for mode, llm in engines.items()}
            rows.append({"batch": batch, "equal": tokens["on"] == tokens["off"]})
        replays = replay_check(graphs)
        timing = bucket_rows(engines["on"].engine, engines["off"].engine, captured, prompt_len=128, steps=30)
    ok = all(row["equal"] for row in rows) and all(r["ok"] for r in replays)
    return {"captured_buckets": captured, "rows": rows, "replays": replays, "timing": timing, "ok": ok,
            "no_bucket_slower_than_eager": all(r["graphs_over_eager"] <= 1.0 for r in timing)}


def cuda_ms(fn: Callable, *args: object) -> float:
    """Median GPU time of fn(*args) over BENCH_ITERS calls after a warm-up (which also compiles),
    with the L2 cache flushed before each call: a real step reads each layer's K/V once, cold."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")  # well past any L2
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(BENCH_ITERS):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def render_registry(result: dict) -> list[str]:
    lines = ["kernel registry on this GPU (bf16, Llama-3-70B layer shapes):", ""]
    for op, entry in result["registry"].items():
        rejected = "; ".join(f"{r['impl']}: {r['reason']}" for r in entry["rejected"])
        lines.append(f"  {op:<18} {entry['chosen']:<10} {rejected}".rstrip())
    greedy = result["greedy"]
    lines += ["", (f"greedy generation vs transformers (fp32, kernels {greedy['kernels']}): "
                  f"{greedy['equal']} of {greedy['prompts']} prompts equal"), ""]
    return lines


def render(result: dict) -> str:
    env = result["environment"]
    title = (f"{env['device']} ({env['capability']}), torch {env['torch']}, CUDA {env['cuda']}, "
             f"Triton {env['triton']}")
    lines = [title, "", *render_registry(result),
             "| op | dtype | case | max abs err | tolerance | ok |", "|---|---|---|---:|---:|---|"]
    for row in result["kernels"]:
        lines.append(f"| {row['op']} | {row['dtype']} | {row['case']} | {row['max_abs_err']:.1e} | "
                     f"{row['tolerance']:.0e} | {'yes' if row['ok'] else 'NO'} |")
    shape = f"H {HEADS} / KVH {KV_HEADS} / D {HEAD_DIM}, block {BLOCK_SIZE}"
    lines += ["", f"decode attention, bf16, {shape}, L2 flushed before each call:", "",
              "| batch | context | splits | triton ms | reference ms | speedup | triton K/V GB/s |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["decode_timing"]:
        lines.append(f"| {row['batch']} | {row['context']} | {row['splits']} | {row['triton_ms']:.3f} | "
                     f"{row['reference_ms']:.3f} | {row['speedup']:.1f}x | {row['triton_kv_gbps']:.0f} |")
    graphs = result["cuda_graphs"]
    lines += ["", (f"CUDA graphs per decode bucket (captured {graphs['captured_buckets']}), 4-layer hidden-256 "
              "Llama, fp32: greedy tokens equal to eager at batches "
              + ", ".join(f"{r['batch']} {'yes' if r['equal'] else 'NO'}" for r in graphs["rows"])),
              "replays without allocation or host sync: "
              + ", ".join(f"{r['bucket']} {'ok' if r['ok'] else 'NO'}" for r in graphs["replays"]), "",
              "| bucket | batch | graphs ms/step | eager ms/step | graphs / eager |", "|---:|---:|---:|---:|---:|"]
    for row in graphs["timing"]:
        lines.append(f"| {row['bucket']} | {row['batch']} | {row['graphs_ms']:.3f} | {row['eager_ms']:.3f} "
                     f"| {row['graphs_over_eager']:.2f} |")
    lora = result["lora_graphs"]
    lines += ["", "Triton LoRA ops replayed from a CUDA graph with new slots (bf16, in 4096 / out 6144 / rank 48): "
              + ", ".join(f"{r['rows']} rows err {r['max_abs_err']:.1e}" for r in lora["rows"])
              + (" ok" if lora["ok"] else " MISMATCH")]
    lines += fused_checks.render({key.removeprefix("fused_"): value for key, value in result.items()
                                  if key.startswith("fused_")})
    return "\n".join(lines)


def main() -> int:
    if not torch.cuda.is_available():
        print(f"check_cuda.py needs a CUDA GPU; torch {torch.__version__} sees none "
              f"(torch.version.cuda = {torch.version.cuda}).", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        print("unset TRITON_INTERPRET: this script checks the compiled kernels", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    with torch.inference_mode():
        result = {"environment": environment(device)}
        result["registry"] = probe_registry(device)
        result["kernels"] = check_kernels(device)
        result["greedy"] = greedy_vs_transformers(device)
        result["decode_timing"] = time_decode(device)
        result["cuda_graphs"] = cuda_graphs(device)
        result["lora_graphs"] = lora_graphs(device)
        result["fused_rms_norm"] = fused_checks.check_fused_op("rms_norm", device, cuda_ms)
        result["fused_rotary"] = fused_checks.check_fused_op("rotary", device, cuda_ms)
        result["fused_silu_and_mul"] = fused_checks.check_fused_op("silu_and_mul", device, cuda_ms)
        result["fused_top_k_top_p"] = fused_checks.check_fused_op("top_k_top_p", device, cuda_ms)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))
    failed = [row for row in result["kernels"] if not row["ok"]]
    for row in failed:
        print(f"MISMATCH {row['op']} {row['dtype']} ({row['case']}): max abs err {row['max_abs_err']:.2e} "
              f"> {row['tolerance']:.0e}", file=sys.stderr)
    greedy = result["greedy"]
    if not greedy["ok"]:
        print(f"MISMATCH greedy generation: {greedy['equal']} of {greedy['prompts']} prompts equal "
              f"transformers", file=sys.stderr)
    if not result["cuda_graphs"]["ok"]:
        print("MISMATCH decode with CUDA graphs differs from eager, or a bucket's replay allocated or synced: "
              f"{result['cuda_graphs']['replays']}", file=sys.stderr)
    if not result["lora_graphs"]["ok"]:
        print(f"MISMATCH LoRA ops replayed from a CUDA graph: {result['lora_graphs']['rows']}", file=sys.stderr)
    fused_failed = [key for key, value in result.items() if key.startswith("fused_") and not value["ok"]]
    for key in fused_failed:
        print(f"MISMATCH {key}: {[row for row in result[key]['rows'] if not row['ok']]}, graph replay equal: "
              f"{result[key]['graph_replay_equal']}", file=sys.stderr)
    checks_ok = greedy["ok"] and result["cuda_graphs"]["ok"] and result["lora_graphs"]["ok"] and not fused_failed
    return 1 if failed or not checks_ok else 0


if __name__ == "__main__":
    sys.exit(main())
