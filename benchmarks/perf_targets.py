"""The performance targets, checked against the committed results of the benchmarks that measure them.

Reads what four benchmark runs wrote and prints one row per target (what was measured, the bound, met or
not), then writes ``benchmarks/results/perf_targets.json``. Exit status 0 when every target is met, 1 when
one is not, 2 when an input is missing or malformed. It runs nothing itself: the measurements are minutes
long and must run on a quiet machine, one after another:

    python benchmarks/compare.py --peers-before-and-after --out-dir benchmarks/results/compare_short
    python benchmarks/compare.py --peers-before-and-after --input-words 189 --out-dir benchmarks/results/compare_long
    python benchmarks/decode_floor.py --points 32x512,32x160 --modes compiled --threads 1,2
    python benchmarks/cold_start.py
    python benchmarks/perf_targets.py        # the committed result: these four results, the defaults

The targets: output tok/s >= 1.4x vLLM's with short prompts and >= 1.3x with ~512-token prompts at every
concurrency (vLLM's figure: the mean of its runs before and after ours), TTFT p50 no worse than vLLM's;
the decode step at batch 32 x 512 within 2x its memory floor (the better thread count: the server picks
its split by measurement); TPOT p50 at c=32 (short prompts) within 1.3x of the decode step at 32 x 160
(that run's mean context); cold start to /health 200 within 40 s. A target holds on a machine: the
result says which (``lscpu`` in cold_start.json), the figures differ between AVX2 and AVX-512 machines.
"""

import argparse
import json
import platform
import sys
from pathlib import Path

from common import RESULTS, ROOT, markdown_table, write_result

SHORT_RATIO, LONG_RATIO = 1.4, 1.3
FLOOR_RATIO, TPOT_RATIO, COLD_START_S = 2.0, 1.3, 40.0
PEER = "vLLM-CPU"


def _runs(path: Path) -> dict[int, dict]:
    """A bench result's runs by concurrency."""
    return {run["concurrency"]: run for run in json.loads(path.read_text())["runs"]}


def throughput_rows(compare_dir: Path, workload: str, bound: float) -> list[dict]:
    """Output tok/s and TTFT p50 against vLLM's (the mean of before and after) at each concurrency."""
    ours = _runs(compare_dir / "xinserve.json")
    peers = [_runs(path) for path in sorted(compare_dir.glob(f"{PEER}_*.json"))]
    if not peers:
        raise FileNotFoundError(f"no {PEER}_*.json in {compare_dir} (run compare.py with --peers-before-and-after)")
    rows = []
    for level, run in sorted(ours.items()):
        theirs = [p[level] for p in peers if level in p]
        if not theirs:
            raise KeyError(f"{PEER} has no run at c={level} in {compare_dir}")
        peer_tok_s = sum(t["output_throughput_tok_s"] for t in theirs) / len(theirs)
        peer_ttft = sum(t["ttft_ms"]["p50"] for t in theirs) / len(theirs)
        ratio = run["output_throughput_tok_s"] / peer_tok_s
        rows.append({"target": f"{workload} prompts, c={level}: output tok/s / {PEER}", "measured": round(ratio, 3),
                     "bound": f">= {bound}", "met": ratio >= bound,
                     "detail": f"{run['output_throughput_tok_s']:.1f} vs {peer_tok_s:.1f} tok/s"})
        ttft = run["ttft_ms"]["p50"]
        rows.append({"target": f"{workload} prompts, c={level}: TTFT p50 (ms)", "measured": round(ttft, 2),
                     "bound": f"<= {PEER}'s {peer_ttft:.2f}", "met": ttft <= peer_ttft,
                     "detail": f"{ttft:.2f} vs {peer_ttft:.2f} ms"})
    return rows


def _best(floor: dict, batch: int, context: int, key: str) -> dict:
    """The row at batch x context with the least ``key`` over the modes and thread counts in the run."""
    rows = [r for r in floor["rows"] if r["batch"] == batch and r["context"] == context]
    if not rows:
        raise KeyError(f"decode_floor has no {batch}x{context} point (run it with --points 32x512,32x160)")
    return min(rows, key=lambda r: r[key])


def floor_rows(floor: dict, short_dir: Path) -> list[dict]:
    """The 32 x 512 step against its memory floor; TPOT at c=32 against the (fastest) 32 x 160 step."""
    at_512 = _best(floor, 32, 512, "step_over_floor")
    step = _best(floor, 32, 160, "step_ms")
    tpot = _runs(short_dir / "xinserve.json")[32]["tpot_ms"]["p50"]
    return [
        {"target": "decode step 32 x 512 / memory floor", "measured": round(at_512["step_over_floor"], 3),
         "bound": f"<= {FLOOR_RATIO}", "met": at_512["step_over_floor"] <= FLOOR_RATIO,
         "detail": (f"{at_512['step_ms']:.2f} ms vs floor {at_512['floor_ms']:.2f} ms ({at_512['mode']}, "
                    f"{at_512['threads']} thread(s), {floor['read_bandwidth_gb_s'][str(at_512['threads'])]:.1f} GB/s)")},
        {"target": "TPOT p50 at c=32 / decode step 32 x 160", "measured": round(tpot / step["step_ms"], 3),
         "bound": f"<= {TPOT_RATIO}", "met": tpot / step["step_ms"] <= TPOT_RATIO,
         "detail": f"{tpot:.2f} vs {step['step_ms']:.2f} ms ({step['mode']}, {step['threads']} thread(s))"},
    ]


def cold_start_row(cold: dict) -> dict:
    first = next((r for r in cold["rows"] if r["start"] == "cold"), None)
    if first is None:
        raise KeyError("cold_start has no cold run")
    seconds = first["health_200_s"]
    return {"target": "cold start to /health 200 (s)", "measured": seconds, "bound": f"<= {COLD_START_S}",
            "met": seconds <= COLD_START_S, "detail": f"buckets compiled in the background by {first['buckets_settled_s']} s"}


def cpu_isa(flags: str | None = None) -> str:
    """AVX-512, AVX2 or the architecture, from CPU flags (default: this machine's): targets hold per kind of CPU."""
    if flags is None:
        try:
            flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("flags")), "")
        except OSError:
            flags = ""
    words = set(flags.split())
    return "AVX-512" if "avx512f" in words else "AVX2" if "avx2" in words else platform.machine()


def check(short_dir: Path, long_dir: Path, floor_path: Path, cold_path: Path) -> dict:
    floor, cold = json.loads(floor_path.read_text()), json.loads(cold_path.read_text())
    rows = [*throughput_rows(short_dir, "short", SHORT_RATIO), *throughput_rows(long_dir, "long", LONG_RATIO),
            *floor_rows(floor, short_dir), cold_start_row(cold)]
    # the CPU the runs measured, as cold_start.py recorded it (lscpu), else this machine's
    inputs = {"short": short_dir, "long": long_dir, "floor": floor_path, "cold_start": cold_path}
    return {"cpu": cpu_isa(cold.get("lscpu", {}).get("Flags")), "inputs": {k: _shown(v) for k, v in inputs.items()},
            "rows": rows, "all_met": all(r["met"] for r in rows)}


def _shown(path: Path) -> str:
    """``path`` relative to the checkout when it lies in it (a result names no machine's folders)."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def table(result: dict) -> str:
    rows = [(r["target"], r["measured"], r["bound"], "yes" if r["met"] else "**no**", r["detail"])
            for r in result["rows"]]
    return "\n".join([f"The performance targets, measured on {result['cpu']}:", "",
                      markdown_table(("target", "measured", "bound", "met", "detail"), rows), "",
                      "every target met" if result["all_met"] else "NOT every target met"])


def main(argv: list[str] | None = None) -> int:

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", type=Path, default=RESULTS / "compare_short", help="compare.py --out-dir, short prompts")
    p.add_argument("--long", type=Path, default=RESULTS / "compare_long", help="compare.py --out-dir, --input-words 189")
    p.add_argument("--floor", type=Path, default=RESULTS / "decode_floor.json", help="decode_floor.py's output")
    p.add_argument("--cold-start", type=Path, default=RESULTS / "cold_start.json", help="cold_start.py's output")
    p.add_argument("--out", type=Path, default=RESULTS / "perf_targets.json")
    args = p.parse_args(argv)
    try:
        result = check(args.short, args.long, args.floor, args.cold_start)
    except (OSError, KeyError, ValueError) as exc:
        print(f"cannot check the targets: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(table(result))
    write_result(args.out, result)
    return 0 if result["all_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
