"""``xinserve bench``: a streaming load generator against any OpenAI-compatible server.

Per load level (``--concurrency 1,8,32`` closed loop, ``--request-rate`` open loop) it sends the
prompts (random words, or a JSONL dataset with categories), each streamed and asking for
``--output-tokens`` tokens (``ignore_eos`` unless ``--no-ignore-eos``), and reports P50/P90/P95/P99
of TTFT, TPOT, ITL and end-to-end latency, request and token throughput and the success rate.

client: one request · dataset: what is sent · load: one level · stats: the numbers ·
report: the tables · plot: the PNG · cli: options and the run · launch: a server process for
the benchmark scripts.
"""

from xinserve.server.cli.bench.cli import add_args, benchmark, run

__all__ = ["add_args", "benchmark", "run"]
