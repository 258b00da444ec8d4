"""The decode step against its memory floor: the step at batch 32 x 512 context is to stay within 2x.

The floor of one decode step is the bytes it must read (every weight once, the embedding only for the
batch's rows, plus the K/V of every layer for every sequence's context, scales included) divided by the
machine's read bandwidth, measured here as the fastest ``torch.sum`` of 256 MB on as many threads. The
step is ``engine.step()`` in a loop, in process, on the 5M Llama (``common.LLAMA_5M``) in float32 with the
C++ decode attention, at batch x context points, with the decode bucket compiled (``compile="on"``, timed
once the warm-up has settled) and eager (``compile="off"``), each on 1 and 2 torch threads. Per point:
the fastest window of steps (wall time: on a shared machine the least disturbed estimate), the process
CPU seconds per step in that window (``time.process_time``, every thread; on 2 threads it includes
spinning at OpenMP barriers), then step / floor against the bandwidth of the same thread count.
``--kv-cache-dtype`` stores the cache in another dtype (its floor reads fewer bytes); ``--omp-wait-policy``
(default PASSIVE, as the server's CPU workers run) is set before torch loads; ``default`` leaves libgomp's
spin-then-sleep. Prints a markdown table and writes ``benchmarks/results/decode_floor.json``, which
``perf_targets.py`` reads. The committed result:

    python benchmarks/decode_floor.py --points 32x512,32x160 --modes compiled --threads 1,2

Smoke run: ``python benchmarks/decode_floor.py --quick --points 2x32 --threads 1 --out /tmp/floor.json``.
"""

import json
import os
import sys
import time

from common import (
    LLAMA_5M,
    decode_engine,
    decoding,
    llama_5m,
    lscpu,
    markdown_table,
    script_args,
    write_result,
)

POINTS = ((32, 512), (8, 512), (32, 64))
SUM_BYTES = 256 << 20


def read_bandwidth(threads: int, repeats: int = 7) -> float:
    """Bytes per second of the fastest ``torch.sum`` over 256 MB of float32 on ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(SUM_BYTES // 4)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return SUM_BYTES / best


def step_bytes(runner, batch: int, context: int) -> dict[str, int]:
    """The bytes one decode step of ``batch`` sequences at ``context`` tokens must read: every parameter
    except the embedding table (of which only ``batch`` rows), and K and V of every layer over every
    context in the cache's dtype, scales included (the model's cache spec)."""
    model = runner.model
    table = model.model.embed_tokens.weight  # [vocab, hidden]; the logits read it whole when tied
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not table)
    weights += batch * table.shape[1] * table.element_size() + (table.nbytes if model.lm_head is None else 0)
    kv = batch * context * model.kv_bytes_per_token(runner.kv_dtype)
    return {"weights": weights, "kv": kv, "total": weights + kv}


def timed_steps(engine, windows: int, window: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) per ``engine.step()`` in the fastest of ``windows`` windows."""
    best = (float("inf"), float("inf"))
    for _ in range(windows):
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(window):
            engine.step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        best = min(best, (wall / window, cpu / window))
    return best


def wait_settled(engine, timeout_s: float = 1800) -> dict:
    """Block until the engine's background warm-up (C++ build, bucket compiles) is over; its report."""
    deadline = time.monotonic() + timeout_s
    while not engine.warmup.report()["settled"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the decode buckets did not settle")
        time.sleep(0.5)
    return engine.warmup.report()


def main() -> None:
    parser = script_args(__doc__, "decode_floor.json", "fewer and shorter windows (a smoke run)")
    parser.add_argument("--points", default=",".join(f"{b}x{c}" for b, c in POINTS),
                        help="batch x context points, comma separated")
    parser.add_argument("--modes", default="compiled,eager")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--omp-wait-policy", default="PASSIVE",
                        help="OMP_WAIT_POLICY of this process (the server's CPU workers run PASSIVE: server/pool/model_pool.py); "
                             "'default' leaves libgomp's (spin, then sleep)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's dtype (auto: the model's)")
    args = parser.parse_args()
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    modes = args.modes.split(",")
    thread_counts = [int(n) for n in args.threads.split(",")]
    windows, window = (3, 4) if args.quick else (5, 10)
    if args.omp_wait_policy != "default":  # before torch loads: libgomp reads it then
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    path = llama_5m(args.model_dir)
    import torch

    bandwidth = {n: read_bandwidth(n) for n in thread_counts}
    print("read bandwidth: " + ", ".join(f"{n} thread(s) {b / 1e9:.1f} GB/s" for n, b in bandwidth.items()),
          file=sys.stderr)
    max_batch, max_context = max(b for b, _ in points), max(c for _, c in points)
    steps = windows * window * len(thread_counts) + 8
    rows = []
    for mode in modes:
        torch.set_num_threads(1)
        llm = decode_engine(path, max_batch, max_context, steps, compile="on" if mode == "compiled" else "off",
                            kernels={"decode_attention": "cpp"}, kv_cache_dtype=args.kv_cache_dtype)
        engine = llm.engine
        report = wait_settled(engine)
        print(f"{mode}: warm-up settled: {json.dumps(report['buckets'])}", file=sys.stderr)
        with torch.inference_mode():
            for batch, context in points:
                floor_bytes = step_bytes(engine.runner, batch, context)
                with decoding(engine, batch, context, steps):
                    for threads in thread_counts:
                        torch.set_num_threads(threads)
                        engine.step()
                        wall, cpu = timed_steps(engine, windows, window)
                        floor_s = floor_bytes["total"] / bandwidth[threads]
                        row = {"mode": mode, "threads": threads, "batch": batch, "context": context,
                               "step_ms": 1e3 * wall, "cpu_ms_per_step": 1e3 * cpu, "bytes": floor_bytes,
                               "floor_ms": 1e3 * floor_s, "step_over_floor": wall / floor_s}
                        rows.append(row)
                        print(f"{mode} {threads}t {batch}x{context}: step {row['step_ms']:.2f} ms "
                              f"(cpu {row['cpu_ms_per_step']:.2f}), floor {row['floor_ms']:.2f} ms, "
                              f"{row['step_over_floor']:.2f}x", file=sys.stderr)
        llm.close()
    result = {"model": LLAMA_5M, "dtype": "float32", "kv_cache_dtype": args.kv_cache_dtype, "decode_attention": "cpp",
              "lscpu": lscpu(), "omp_wait_policy": args.omp_wait_policy, "load_average": os.getloadavg(),
              "read_bandwidth_gb_s": {str(n): b / 1e9 for n, b in bandwidth.items()}, "rows": rows}
    write_result(args.out, result)
    print(markdown_table(
        ("mode", "threads", "batch x context", "weights MB", "K/V MB", "floor ms", "step ms", "CPU ms/step",
         "step / floor"),
        [(r["mode"], r["threads"], f"{r['batch']} x {r['context']}", f"{r['bytes']['weights'] / 1e6:.1f}",
          f"{r['bytes']['kv'] / 1e6:.1f}", f"{r['floor_ms']:.2f}", f"{r['step_ms']:.2f}", f"{r['cpu_ms_per_step']:.2f}",
          f"{r['step_over_floor']:.2f}x") for r in rows]))


if __name__ == "__main__":
    main()
