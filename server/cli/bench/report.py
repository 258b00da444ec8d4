"""Tables of bench results: one block per load level, a per-category table, and a markdown table of
every level (printed after several, and what ``benchmarks/compare.py`` writes)."""

from typing import Any

from xinserve.server.cli.bench.stats import LATENCIES, PERCENTILES

_NAMES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "E2E latency"}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def level_block(run: dict[str, Any]) -> str:
    rows = [
        ("Successful requests", f"{run['successful']} of {run['requests']} ({run['success_rate']:.1%})"),
        ("Duration (s)", f"{run['duration_s']:.2f}"),
        ("Request throughput (req/s)", f"{run['request_throughput_per_s']:.2f}"),
        ("Prompt / output tokens", f"{run['prompt_tokens']} / {run['output_tokens']}"),
        ("Output token throughput (tok/s)", f"{run['output_throughput_tok_s']:.1f}"),
        ("Total token throughput (tok/s)", f"{run['total_throughput_tok_s']:.1f}"),
    ]
    if "client_cpu_s" in run:  # absent from results saved before it was recorded
        rows.append(("Load generator CPU (s)", f"{run['client_cpu_s']:.2f}"))
    quantiles = " / ".join(f"p{q}" for q in PERCENTILES)
    for key in LATENCIES:
        d = run[key]
        rows.append((f"{_NAMES[key]} mean / {quantiles} (ms)",
                     " / ".join(_ms(d[k]) for k in ("mean", *(f"p{q}" for q in PERCENTILES)))))
    width = max(len(label) for label, _ in rows)
    lines = [f"==== {run['label']} ===="] + [f"{label:<{width}}  {value}" for label, value in rows]
    lines += [f"error ({e['count']}x): {e['error']}" for e in run.get("errors", [])]
    return "\n".join(lines)


def category_table(categories: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| category | requests | success | prompt tok | output tok | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in categories.items():
        lines.append(
            f"| {name} | {c['requests']} | {c['success_rate']:.1%} | {c['prompt_tokens']} | {c['output_tokens']} "
            f"| {_ms(c['ttft_ms']['p50'])} | {_ms(c['ttft_ms']['p99'])} | {_ms(c['e2e_ms']['p50'])} "
            f"| {_ms(c['e2e_ms']['p99'])} |"
        )
    return "\n".join(lines)


def levels_table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per load level of each result (a ``xinserve bench --json`` document)."""
    lines = [
        ("| server | load | success | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
         "| ITL p50 / p99 ms | E2E p50 / p99 ms |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        for run in result["runs"]:
            cells = [f"{_ms(run[k]['p50'])} / {_ms(run[k]['p99'])}" for k in LATENCIES]
            lines.append(
                f"| {result['label']} | {run['label']} | {run['success_rate']:.1%} "
                f"| {run['request_throughput_per_s']:.2f} | {run['output_throughput_tok_s']:.1f} | "
                + " | ".join(cells) + " |"
            )
    return "\n".join(lines)
