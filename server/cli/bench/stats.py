"""Summaries of a run: throughput, success rate, and latency percentiles (milliseconds).

TTFT is sending to the first text; TPOT a request's (end - first text) / (output tokens - 1), the
mean time per token after the first; ITL each gap between successive pieces of text, over all
requests; E2E sending to the end of the stream. Percentiles are numpy's linear interpolation
between the closest ranks (vLLM's bench does the same). Only successful requests have latencies
and tokens.
"""

from collections import Counter, defaultdict
from typing import Any

import numpy as np

from xinserve.server.cli.bench.client import RequestResult

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def distribution(values: list[float]) -> dict[str, float | None]:
    """Mean and P50/P90/P95/P99 of ``values``; every entry None when there are none."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    points = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
    return {"mean": float(np.mean(values)), **{f"p{q}": float(v) for q, v in zip(PERCENTILES, points)}}


def latencies_ms(results: list[RequestResult]) -> dict[str, list[float]]:
    ok = [r for r in results if r.ok]
    return {
        "ttft_ms": [r.ttft * 1000 for r in ok],
        "tpot_ms": [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1],
        "itl_ms": [gap * 1000 for r in ok for gap in r.itls],
        "e2e_ms": [r.latency * 1000 for r in ok],
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    summary: dict[str, Any] = {
        "requests": len(results),
        "successful": len(ok),
        "failed": len(results) - len(ok),
        "success_rate": len(ok) / len(results) if results else 0.0,
        "duration_s": duration,
        "request_throughput_per_s": per_s(len(ok)),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_throughput_tok_s": per_s(output_tokens),
        "total_throughput_tok_s": per_s(prompt_tokens + output_tokens),
    }
    summary.update({name: distribution(values) for name, values in latencies_ms(results).items()})
    errors = Counter(r.error for r in results if not r.ok)
    if errors:
        summary["errors"] = [{"error": e, "count": n} for e, n in errors.most_common(5)]
    return summary


def by_category(results: list[RequestResult]) -> dict[str, dict[str, Any]]:
    """Per dataset category: requests, success rate, output tokens, TTFT and E2E distributions."""
    groups: dict[str, list[RequestResult]] = defaultdict(list)
    for r in results:
        groups[r.category or "(none)"].append(r)
    table = {}
    for category, rs in sorted(groups.items()):
        ok = [r for r in rs if r.ok]
        lat = latencies_ms(rs)
        table[category] = {
            "requests": len(rs),
            "successful": len(ok),
            "success_rate": len(ok) / len(rs),
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "output_tokens": sum(r.output_tokens for r in ok),
            "ttft_ms": distribution(lat["ttft_ms"]),
            "e2e_ms": distribution(lat["e2e_ms"]),
        }
    return table
