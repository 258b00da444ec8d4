"""Does a replica that reports ready serve at full speed? Seconds to /health 200, then streamed chat at
c=1, 8 and 32 started right after ready ("first"), and the same levels again once the warm-up settled
("settled", the median of ``--settled-passes`` passes): output tok/s, their ratio, and every inter-token
gap (max and p99).

Three starts of the default ``xinserve serve`` (the embedded model), each on the caches named in its row,
and all three ``--repeats`` times (3), each repeat on empty caches of its own: the table shows per start the
median /health 200 and per level the repeat of median first / settled, with every repeat's figure beside
it, and the worst first-run gap of any repeat. One pass is not enough here: on the 2-core reference machine
a single-threaded loop switches speed by up to 1.6x from one second to the next (measured), so one pass of a
few seconds can land either side of a target that another pass meets.

- ``ready-when-warm, empty caches``: ``--ready-when-warm`` on fresh empty cache directories
  ($XINSERVE_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR under one temporary directory: the embedded model, the
  decode buckets, inductor's code). What the install made is used as a user's server uses it: its C++
  kernels for this CPU and its bytecode (make's install step: kernels/cpu/cpp_build.py ``--install``,
  server/cli/bytecode.py); without them the kernels build into the same temporary directory;
- ``ready-when-warm, warm caches``: a second start on the same, now warm, directories;
- ``ready-first, empty caches``: the default (ready first, warm-up in the background), for comparison.

The targets (issue 43, 2 cores, quiet machine): /health 200 within 40 s, first / settled output tok/s at
least 0.85 at every level, no inter-token gap over 50 ms caused by compilation (in the first run of a start
still compiling after ready; a start settled at ready compiles nothing then, and its gaps, shown beside
its settled pass's, are the machine's); each row lists the targets it missed. Each level sends 8 x c
requests of 32 random words (about 32 tokens) for 128 tokens each (``ignore_eos``). ``--quick`` starts
the servers with ``XINSERVE_COMPILE=off`` (no bucket to compile, as the test suite starts its servers) and
forces the reference kernels where the C++ ones would be built (so nothing is left to warm up) and sends
a few short requests at c=1 and 4: a smoke test of the script, not a figure. Prints a table and
writes ``benchmarks/results/warm_start.json`` with the machine's ``lscpu`` and the load average. The
server is started from this checkout (PYTHONPATH set to it). The committed result:

    python benchmarks/warm_start.py

Smoke run: ``python benchmarks/warm_start.py --quick --out /tmp/warm_start.json``.
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
from common import (
    RESULTS,
    decode_graphs,
    default_server,
    lscpu,
    markdown_table,
    poll_health,
    write_result,
)

from xinserve.server.cli.bench import dataset
from xinserve.server.cli.bench.client import RequestResult, one_request
from xinserve.server.cli.bench.load import Level, run_level
from xinserve.server.cli.bench.stats import distribution, summarize

MODEL = "xinserve-tiny"
# --quick: the reference kernels where the C++ ones would build (minutes) in the background.
QUICK_ENV = {"XINSERVE_KERNELS": "write_kv=reference,decode_attention=reference,linear=reference"}
TARGETS = {"health_200_s": 40.0, "first_over_settled": 0.85, "max_itl_ms": 50.0}
# (row, --ready-when-warm, its cache directory: the second start reuses the first's)
STARTS = (("ready-when-warm, empty caches", True, "a"), ("ready-when-warm, warm caches", True, "a"),
          ("ready-first, empty caches", False, "b"))


async def _level(base: str, concurrency: int, requests: int, words: int, tokens: int,
                 seed: int) -> tuple[list[RequestResult], float]:
    prompts = dataset.random_prompts(requests, words, seed=seed)
    bodies = [dataset.payload(p, MODEL, "chat", tokens, ignore_eos=True) for p in prompts]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency + 2)) as session:
        results, duration = await run_level(lambda body: one_request(session, f"{base}/v1/chat/completions", body),
                                            bodies, Level(concurrency, float("inf")), seed=0)
    return results, duration


def machine_probe_ms() -> float:
    """The machine's speed just before a pass: ms of a fixed single-threaded Python loop (the reference
    machine's speed drifts by up to 1.6x from one second to the next; a pass's figure is read beside it)."""
    start = time.perf_counter()
    total = 0
    for i in range(300_000):
        total += i
    return round((time.perf_counter() - start) * 1e3, 2)


def measure_level(base: str, concurrency: int, requests: int, words: int, tokens: int, run: int = 0) -> dict:
    """One closed-loop level: output tok/s, failures and the inter-token gaps (ms) of every request. Each
    ``run`` of a level sends prompts of its own: a pass never finds an earlier pass's prompts in the prefix
    cache (which would skip their prefill and flatter the later pass)."""
    probe_ms = machine_probe_ms()
    results, duration = asyncio.run(_level(base, concurrency, requests, words, tokens, seed=1000 * run + concurrency))
    summary = summarize(results, duration)
    gaps = [gap * 1000 for r in results if r.ok for gap in r.itls]
    return {"output_tok_s": round(summary["output_throughput_tok_s"], 1), "failed": summary["failed"],
            "machine_probe_ms": probe_ms,
            "max_itl_ms": round(max(gaps), 2) if gaps else None,
            "p99_itl_ms": round(distribution(gaps)["p99"], 2) if gaps else None,
            "gaps_over_50_ms": sum(gap > TARGETS["max_itl_ms"] for gap in gaps)}


def one_start(cache: Path, ready_when_warm: bool, args: argparse.Namespace) -> dict:
    """Start the server on ``cache``; /health 200, the levels right after it, the levels once settled."""
    flags = ["--ready-when-warm"] if ready_when_warm else []
    row: dict = {}
    with (default_server(cache, args.quick, flags, QUICK_ENV if args.quick else None) as (proc, base, start),
          httpx.Client(timeout=10) as client):
        health = poll_health(client, base, start, args.timeout, lambda code, _: code == 200, proc)
        row["health_200_s"] = round(time.perf_counter() - start, 2)
        graphs = decode_graphs(health)
        row["settled_at_ready"], row["progress_at_ready"] = bool(graphs.get("settled")), graphs.get("progress")
        levels = [(c, max(args.min_requests, args.requests_per_c * c)) for c in args.concurrency]
        first = {c: measure_level(base, c, n, args.input_words, args.output_tokens) for c, n in levels}
        try:
            poll_health(client, base, start, args.timeout, lambda _, h: bool(decode_graphs(h).get("settled")), proc)
            row["settled_s"] = round(time.perf_counter() - start, 2)
        except TimeoutError:  # the settled figures are then taken as they are, and marked
            row["settled_s"] = None
        # The settled figure is the median of a few passes: one pass of a few seconds varies by up to ~30% on a
        # shared 2-core machine, and a lucky settled pass would make the first look slow.
        settled = {c: median_pass([measure_level(base, c, n, args.input_words, args.output_tokens, run)
                                   for run in range(1, args.settled_passes + 1)]) for c, n in levels}
    row["levels"] = [{"concurrency": c, "requests": n, "first": first[c], "settled": settled[c],
                      "first_over_settled": round(first[c]["output_tok_s"] / settled[c]["output_tok_s"], 3)
                      if settled[c]["output_tok_s"] else None} for c, n in levels]
    return row


def median_pass(passes: list[dict]) -> dict:
    """The pass of median output tok/s, with every pass's tok/s (``passes_tok_s``)."""
    ranked = sorted(passes, key=lambda p: p["output_tok_s"])
    return {**ranked[len(ranked) // 2], "passes_tok_s": [p["output_tok_s"] for p in passes]}


def across_repeats(rows: list[dict]) -> dict:
    """One start's repeats as one row: the median /health 200; per level the repeat of median first / settled
    (with every repeat's ratio in ``ratios``) and the worst first-run gap of any repeat."""
    summary = {**rows[0], "health_200_s": statistics.median(r["health_200_s"] for r in rows),
               "health_200_runs_s": [r["health_200_s"] for r in rows],
               "settled_at_ready": all(r["settled_at_ready"] for r in rows), "levels": []}
    for i, level in enumerate(rows[0]["levels"]):
        runs = [r["levels"][i] for r in rows]
        ranked = sorted(runs, key=lambda run: run["first_over_settled"] or 0.0)
        gaps = [run["first"]["max_itl_ms"] for run in runs if run["first"]["max_itl_ms"] is not None]
        middle = ranked[len(ranked) // 2]
        summary["levels"].append({**middle, "ratios": [run["first_over_settled"] for run in runs],
                                  "first": {**middle["first"], "max_itl_ms": max(gaps) if gaps else None,
                                            "failed": sum(run["first"]["failed"] for run in runs)}})
    return summary


def missed(row: dict) -> list[str]:
    """The targets a start missed, each with its figure; empty when it met them all."""
    out = [f"/health 200 {row['health_200_s']} s > {TARGETS['health_200_s']:g}"] \
        if row["health_200_s"] > TARGETS["health_200_s"] else []
    for level in row["levels"]:
        c, first, ratio = level["concurrency"], level["first"], level["first_over_settled"]
        if first["failed"] or level["settled"]["failed"]:
            out.append(f"c={c} failed requests")
        if ratio is None or ratio < TARGETS["first_over_settled"]:
            out.append(f"c={c} first / settled {ratio} < {TARGETS['first_over_settled']:g}")
        # The target is no gap over 50 ms caused by compilation: a start settled at ready compiles nothing
        # after it, so its gaps are the machine's own (its settled pass shows alike; both are in the table).
        compiling = not row["settled_at_ready"]
        if compiling and (first["max_itl_ms"] is None or first["max_itl_ms"] > TARGETS["max_itl_ms"]):
            out.append(f"c={c} max ITL {first['max_itl_ms']} ms > {TARGETS['max_itl_ms']:g}")
    return out


def table(rows: list[dict]) -> str:
    headings = ("start", "/health 200 s, median (each repeat)", "settled at ready", "c", "first tok/s",
                "settled tok/s", "first / settled, median (each repeat)",
                "max ITL ms first (settled)", "p99 ITL ms first (settled)", "missed targets")
    lines = []
    for row in rows:
        for level in row["levels"]:
            first, settled = level["first"], level["settled"]
            runs = row.get("health_200_runs_s", [row["health_200_s"]])
            ratios = level.get("ratios", [level["first_over_settled"]])
            lines.append((row["start"], f"{row['health_200_s']} ({' / '.join(map(str, runs))})",
                          row["settled_at_ready"], level["concurrency"], first["output_tok_s"],
                          settled["output_tok_s"], f"{level['first_over_settled']} ({' / '.join(map(str, ratios))})",
                          f"{first['max_itl_ms']} ({settled['max_itl_ms']})",
                          f"{first['p99_itl_ms']} ({settled['p99_itl_ms']})",
                          "; ".join(m for m in row["missed"] if not m.startswith("c=")
                                    or m.startswith(f"c={level['concurrency']} ")) or "none"))
    return markdown_table(headings, lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="compile off, a few short requests at c=1 and 4")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to /health 200, and to settled")
    parser.add_argument("--out", type=Path, default=RESULTS / "warm_start.json")
    parser.add_argument("--requests-per-c", type=int, default=8,
                        help="requests per level: this many times its concurrency (8 x 1 at c=1 is about a second)")
    parser.add_argument("--settled-passes", type=int, default=3, help="passes per level once settled (the median counts)")
    parser.add_argument("--repeats", type=int, default=3, help="each start this many times, on caches of its own")
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)  # the benchmark smoke tests' common option
    args = parser.parse_args(argv)
    args.concurrency = [1, 4] if args.quick else [1, 8, 32]
    args.requests_per_c, args.min_requests = (1, 2) if args.quick else (args.requests_per_c, 4)
    args.settled_passes = 1 if args.quick else args.settled_passes
    args.repeats = 1 if args.quick else args.repeats
    args.input_words, args.output_tokens = (8, 8) if args.quick else (32, 128)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[dict] = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="xinserve-warm-") as tmp:  # empty caches for each repeat
            for name, ready_when_warm, caches in STARTS:
                cache = Path(tmp) / caches
                cache.mkdir(exist_ok=True)
                row = {"start": name, "repeat": repeat, "ready_when_warm": ready_when_warm,
                       **one_start(cache, ready_when_warm, args)}
                rows.append(row)
                print(f"{name} (repeat {repeat}): /health 200 after {row['health_200_s']} s", file=sys.stderr)
    summary = [across_repeats([row for row in rows if row["start"] == name]) for name, _, _ in STARTS]
    for row in summary:
        row["missed"] = missed(row)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(table(summary))
    write_result(args.out, {"lscpu": lscpu(), "compile": "off" if args.quick else "default",
                            "load_average_1_5_15": load, "targets": TARGETS, "repeats": args.repeats,
                            "summary": summary, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
