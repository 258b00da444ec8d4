"""Throughput and latency percentiles against load, one line per server (result file), as a PNG.

The x axis is the concurrency, or the request rate when the runs are open loop. matplotlib is an
optional dependency (``pip install 'xinserve[bench]'``); the Agg backend needs no display.
"""

import math
from pathlib import Path
from typing import Any

_PANELS = (
    ("output_throughput_tok_s", None, "output throughput (tok/s)"),
    ("ttft_ms", ("p50", "p99"), "TTFT (ms)"),
    ("tpot_ms", ("p50", "p99"), "TPOT (ms)"),
    ("e2e_ms", ("p50", "p99"), "end-to-end latency (ms)"),
)


def _x(run: dict[str, Any], open_loop: bool) -> float:
    return run["request_rate"] if open_loop else run["concurrency"]


def _value(v: float | None) -> float:
    return math.nan if v is None else v


def plot(results: list[dict[str, Any]], out: str | Path) -> Path:
    """Draw ``results`` (``xinserve bench --json`` documents) into ``out``; returns its path."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("xinserve bench: --plot needs matplotlib: pip install 'xinserve[bench]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    runs = [run for result in results for run in result["runs"]]
    open_loop = any(run["request_rate"] is not None for run in runs)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    for ax, (key, quantiles, title) in zip(axes.flat, _PANELS):
        for i, result in enumerate(results):
            colour = f"C{i}"
            # With open-loop runs, closed-loop ones (no rate) have no place on the axis.
            points = sorted((run for run in result["runs"] if _x(run, open_loop) is not None),
                            key=lambda run: _x(run, open_loop))
            xs = [_x(run, open_loop) for run in points]
            if quantiles is None:
                ax.plot(xs, [run[key] for run in points], "o-", color=colour, label=result["label"])
                continue
            for q, style in zip(quantiles, ("o-", "s--")):
                ax.plot(xs, [_value(run[key][q]) for run in points], style, color=colour,
                        label=f"{result['label']} {q.upper()}")
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)" if open_loop else "concurrency")
        if not open_loop:
            ax.set_xscale("log", base=2)
            ticks = sorted({run["concurrency"] for run in runs})
            ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
