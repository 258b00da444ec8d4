"""CPU time per output token in the HTTP process and in the worker, per arm, under the same load.

Wall time on a shared machine is noise; the CPU each process spends per token is not (much). Each arm
is a server (the 5M Llama, ``common.LLAMA_5M``, float32, compile off) started from a checkout with extra
CLI flags: ``after`` (this checkout), ``after, off`` (``--no-async-scheduling``; ``--no-off-arm`` leaves
it out) and, with ``--before CHECKOUT``, another checkout (a ``git worktree`` of another revision).
After a warm-up run, the user + system CPU of the HTTP process and of the worker process (every thread,
from /proc/PID/stat) is read before and after each load level (``xinserve bench``, streamed chat), and
divided by the level's output tokens. Arms run one after another per level and repeat, alternating
order. ``--before-without httptools,uvloop`` hides packages from the before arm (a stub module that
fails to import, first on its path), to measure a checkout as it ran before they were installed.
Writes ``benchmarks/results/server_path_cpu.json``. The committed result (before: main, after: a
change; the arms' roots are recorded by name):

    git worktree add ../main main
    python benchmarks/server_path_cpu.py --before ../main --no-off-arm --concurrency 8,32 --repeats 3

Smoke run: ``python benchmarks/server_path_cpu.py --no-off-arm --concurrency 2 --repeats 1 --output-tokens 8
--out /tmp/spc.json``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from common import LLAMA_5M, RESULTS, ROOT, write_result

from xinserve.server.cli.bench import launch
from xinserve.server.cli.bench.cli import machine
from xinserve.server.embedded_model.factory import ensure_tiny_model

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime: fields 14 and 15 of stat(5)


def _arms(args: argparse.Namespace) -> list[tuple[str, Path, list[str]]]:
    arms = [("after", ROOT, [])]
    if not args.no_off_arm:
        arms.append(("after, off", ROOT, ["--no-async-scheduling"]))
    if args.before is not None:
        arms.insert(0, ("before", args.before.resolve(), []))
    return arms


def _hidden(names: list[str], scratch: Path) -> list[str]:
    """A folder of stubs that fail to import, for the front of a path: uvicorn's "auto" falls back."""
    if not names:
        return []
    stubs = scratch / "hidden"
    stubs.mkdir(exist_ok=True)
    for name in names:
        (stubs / f"{name}.py").write_text(f"raise ImportError('{name} hidden by the benchmark')\n")
    return [str(stubs)]


def _start(label: str, root: Path, flags: list[str], model: Path, scratch: Path, hidden: list[str]):
    port = launch.free_port()
    cmd = [sys.executable, "-m", "xinserve.server.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", *flags]
    # No compile thread beside the measurement: its CPU would land on the worker's account.
    env = {"PYTHONPATH": os.pathsep.join([*_hidden(hidden, scratch), str(root)]), "XINSERVE_COMPILE": "off"}
    proc = launch.start(cmd, scratch / f"{label.replace(' ', '_')}.log", root, env)
    return proc, f"http://127.0.0.1:{port}"


def _bench(url: str, concurrency: int, words: int, prompts: int, tokens: int, out: Path) -> dict:
    """One ``xinserve bench`` level against ``url``: output tok/s, mean TTFT and TPOT, failures."""
    cmd = [sys.executable, "-m", "xinserve.server.cli", "bench", "--base-url", f"{url}/v1", "--concurrency",
           str(concurrency), "--num-prompts", str(prompts), "--output-tokens", str(tokens), "--input-words", str(words),
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    run = json.loads(out.read_text())["runs"][0]
    return {"output_tok_s": run["output_throughput_tok_s"], "ttft_ms": run["ttft_ms"]["mean"],
            "tpot_ms": run["tpot_ms"]["mean"], "failed": run["failed"]}


def _worker_pid(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).json()["workers"][0]["ranks"][0]["pid"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, help="an older checkout to measure as a third arm")
    p.add_argument("--before-without", default="", help="packages the before arm must not import")
    p.add_argument("--no-off-arm", action="store_true", help="no --no-async-scheduling arm")
    p.add_argument("--server-flags", default="", help="flags for every arm's server, e.g. '--cpu-threads 1' "
                   "(the same worker threads in every arm, not each start's own timing)")
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--input-words", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "server_path_cpu.json")
    args = p.parse_args(argv)
    arms = _arms(args)
    runs: dict[str, dict[str, list[dict]]] = {label: {} for label, _, _ in arms}
    with tempfile.TemporaryDirectory(prefix="xinserve-cpu-") as tmp:
        scratch = Path(tmp)
        model = ensure_tiny_model(scratch, "llama-h256-l4", **LLAMA_5M)
        hide = [m for m in args.before_without.split(",") if m]
        procs = {label: _start(label, root, [*flags, *args.server_flags.split()], model, scratch,
                               hide if label == "before" else [])
                 for label, root, flags in arms}
        try:
            pids = {}
            for label, (proc, url) in procs.items():
                launch.wait_ready(url, proc, None, timeout=1800)
                _bench(url, 4, args.input_words, 8, args.output_tokens, scratch / "warm.json")
                pids[label] = (proc.pid, _worker_pid(url))
            for rep in range(args.repeats):
                for conc in map(int, args.concurrency.split(",")):
                    for label in procs if rep % 2 == 0 else reversed(procs):
                        http_pid, worker_pid = pids[label]
                        before = cpu_s(http_pid), cpu_s(worker_pid)
                        prompts = 2 * conc
                        try:
                            r = _bench(procs[label][1], conc, args.input_words, prompts, args.output_tokens,
                                       scratch / "run.json")
                        except RuntimeError as exc:  # e.g. a worker the heartbeat gave up on under load
                            print(f"rep {rep} c={conc} {label}: {str(exc)[-300:]}", flush=True)
                            continue
                        tokens = prompts * args.output_tokens
                        r["http_cpu_us_per_token"] = (cpu_s(http_pid) - before[0]) / tokens * 1e6
                        r["worker_cpu_us_per_token"] = (cpu_s(worker_pid) - before[1]) / tokens * 1e6
                        runs[label].setdefault(f"c={conc}", []).append(r)
                        print(f"rep {rep} c={conc:<3} {label:<12} HTTP {r['http_cpu_us_per_token']:7.1f} us/token  "
                              f"worker {r['worker_cpu_us_per_token']:7.1f} us/token  "
                              f"({r['output_tok_s']:.0f} tok/s, noisy)", flush=True)
                        _write(args, arms, runs, None)  # what is done so far survives an interrupted run
        finally:
            for proc, _ in procs.values():
                launch.stop(proc)
    summary = {level: {label: {key: statistics.median(r[key] for r in runs[label][level])
                               for key in ("http_cpu_us_per_token", "worker_cpu_us_per_token", "output_tok_s")}
                       for label in runs if runs[label].get(level)} for level in dict.fromkeys(k for r in runs.values() for k in r)}
    print(f"{'level':<8}" + "".join(f"{label + ' HTTP us/tok':>22}{'worker us/tok':>15}" for label in runs))
    for level, row in summary.items():
        print(f"{level:<8}" + "".join(f"{row[x]['http_cpu_us_per_token']:>22.1f}{row[x]['worker_cpu_us_per_token']:>15.1f}"
                                      for x in row))
    _write(args, arms, runs, summary)
    print(f"wrote {args.out}")
    return 0


def _write(args: argparse.Namespace, arms: list, runs: dict, summary: dict | None) -> None:
    # An arm's root by its folder's name (this checkout, or --before's), not a machine's path.
    write_result(args.out, {"machine": machine(), "load_average": os.getloadavg(),
                            "arms": [{"label": label, "root": root.name, "flags": flags} for label, root, flags in arms],
                            "before_without": args.before_without, "server_flags": args.server_flags,
                            "input_words": args.input_words, "output_tokens": args.output_tokens,
                            "runs": runs, "summary": summary})


if __name__ == "__main__":
    raise SystemExit(main())
