"""Where a decode step's time goes in the real server under compare.py's c=32 short load.

Each arm is ``xinserve serve`` on the 5M float32 Llama with its own flags and process layout
(``--arm label=flags[@pin]``; ``@pin`` places the worker's threads on core 0 and the HTTP process's
on the other cores, from outside, with ``sched_setaffinity``). Every arm's server is started once;
the load (``xinserve bench``: 32 streamed chat requests at once, 32-word prompts, 128 output tokens)
then runs arm after arm, alternating the order each repeat. Inside the worker a hook installed from
outside the product code (benchmarks/step_timeline_hook.py) records the step loop; from it, per
steady decode step of the full batch: the period between forward starts, the forward's wall and CPU
(on its thread: wall minus CPU is time off the core or waiting for the GIL), the gap between
forwards, and the loop thread's time blocked on the step, scheduling the next and sending outputs;
per thread, CPU and context switches per step. From /proc: the HTTP process's CPU per step; from
the client: TPOT and output tok/s. TPOT / period says how much of the client's per-token time the
worker's step explains.

Run: python benchmarks/server_step_timeline.py --arm 'auto=' --arm 't1=--cpu-threads 1' \
       --arm 't1pin=--cpu-threads 1@pin' --arm 'sw=XINSERVE_BENCH_SWITCH_INTERVAL_S=0.0002 --cpu-threads 1' [--repeats 3] [--concurrency 32]
"""

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.server_path_ab import LLAMA_5M
from benchmarks.server_path_cpu import cpu_s
from xinserve.server.bench import launch
from xinserve.server.bench.cli import machine
from xinserve.server.embedded_model.factory import ensure_tiny_model

SITECUSTOMIZE = "import os\nif os.environ.get('XINSERVE_STEP_TIMELINE'):\n" \
                "    from benchmarks import step_timeline_hook\n    step_timeline_hook.patch_worker_loop()\n"


def _tasks(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def _pin(pids: list[int], cores: set[int]) -> None:
    for pid in pids:
        for tid in _tasks(pid):
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:  # a thread that ended meanwhile
                pass


def _start(label: str, words: str, model: Path, scratch: Path) -> tuple[subprocess.Popen, str, Path]:
    """``words``: NAME=VALUE environment settings, then the server's flags."""
    settings = [w for w in words.split() if "=" in w and not w.startswith("-")]
    flags = [w for w in words.split() if w not in settings]
    hook_dir = scratch / "hook"
    hook_dir.mkdir(exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = scratch / f"timeline-{label}"
    out.mkdir()
    port = launch.free_port()
    cmd = [sys.executable, "-m", "xinserve.server.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", *flags]
    env = {"PYTHONPATH": os.pathsep.join([str(hook_dir), str(ROOT)]), "XINSERVE_STEP_TIMELINE": str(out),
           **dict(w.split("=", 1) for w in settings)}
    proc = launch.start(cmd, scratch / f"{label}.log", ROOT, env)
    return proc, f"http://127.0.0.1:{port}", out


def _bench(url: str, concurrency: int, prompts: int, words: int, tokens: int, out: Path) -> tuple[dict, float]:
    """The bench's first run and the client's CPU seconds (its start-up imports included)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [sys.executable, "-m", "xinserve.server.cli", "bench", "--base-url", f"{url}/v1", "--concurrency", str(concurrency),
           "--num-prompts", str(prompts), "--output-tokens", str(tokens), "--input-words", str(words),
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"bench failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    client_cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return json.loads(out.read_text())["runs"][0], client_cpu


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def analyse(timeline: dict, batch: int) -> dict:
    """Per steady decode step of ``batch`` rows (milliseconds): medians over the steps."""
    events = timeline["events"]
    forwards = [e for e in events if e[0] == "forward"]
    full = [i for i, e in enumerate(forwards) if e[6] == batch]
    # Steps of the full batch that follow one: the decode plateau, prefill and the tail left out.
    pairs = [(forwards[i], forwards[i + 1]) for i in full if i + 1 < len(forwards) and forwards[i + 1][6] == batch]
    period = [1e3 * (b[2] - a[2]) for a, b in pairs]
    gap = [1e3 * (b[2] - a[3]) for a, b in pairs]
    fwd_wall = [1e3 * (a[3] - a[2]) for a, _ in pairs]
    fwd_cpu = [1e3 * (a[5] - a[4]) for a, _ in pairs]
    lo, hi = (pairs[0][0][2], pairs[-1][1][2]) if pairs else (0, 0)
    steps = max(1, len(pairs))

    def per_step(name: str) -> tuple[float, float]:
        """Wall and CPU ms per step of ``name`` events inside the plateau."""
        inside = [e for e in events if e[0] == name and lo <= e[2] < hi]
        return (1e3 * sum(e[3] - e[2] for e in inside) / steps, 1e3 * sum(e[5] - e[4] for e in inside) / steps)

    counted = len(forwards) or 1
    threads: dict[str, dict[str, float]] = {}
    for task in timeline["tasks"].values():
        name = task["name"]
        group = threads.setdefault(name, {"cpu_ms": 0.0, "voluntary": 0.0, "involuntary": 0.0})
        group["cpu_ms"] += 1e3 * task["cpu_s"] / counted
        group["voluntary"] += task["voluntary"] / counted
        group["involuntary"] += task["involuntary"] / counted
    return {
        "plateau_steps": len(pairs),
        "forwards": len(forwards),
        "period_ms": _median(period),
        "period_ms_mean": sum(period) / len(period) if period else float("nan"),
        "forward_wall_ms": _median(fwd_wall),
        "forward_cpu_ms": _median(fwd_cpu),
        "gap_ms": _median(gap),
        **{f"{name}_ms_per_step": per_step(name) for name in ("run", "wait", "launch", "resolve", "emit", "drain")},
        "threads_per_forward": {k: {m: round(v, 3) for m, v in g.items()} for k, g in threads.items()},
    }


def _arm(text: str) -> tuple[str, str, bool]:
    label, _, rest = text.partition("=")
    flags, _, layout = rest.partition("@")
    return label, flags, layout == "pin"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", action="append", required=True, help="label=[NAME=VALUE ...] server flags[@pin]")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-words", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--keep", type=Path, help="a folder for the logs and timelines, kept (default: a temporary one)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "server_step_timeline.json")
    args = p.parse_args(argv)
    arms = [_arm(a) for a in args.arm]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in arms}
    with tempfile.TemporaryDirectory(prefix="xinserve-timeline-") as tmp:
        scratch = args.keep or Path(tmp)
        scratch.mkdir(parents=True, exist_ok=True)
        model = ensure_tiny_model(Path(tempfile.gettempdir()) / "xinserve-timeline-model", "llama-h256-l4", **LLAMA_5M)
        servers = {label: _start(label, flags, model, scratch) for label, flags, _ in arms}
        try:
            pids = {}
            for (label, _, pin), (proc, url, _) in zip(arms, servers.values()):
                launch.wait_ready(url, proc, scratch / f"{label}.log", timeout=1800)
                from benchmarks.compare import wait_warmed_up

                wait_warmed_up(url, 1800)
                health = httpx.get(f"{url}/health", timeout=10).json()["workers"][0]
                worker = health["ranks"][0]["pid"]
                pids[label] = (proc.pid, worker)
                if pin:
                    cores = os.sched_getaffinity(0)
                    first = min(cores)
                    _pin([worker], {first})
                    _pin([proc.pid], cores - {first})
                _bench(url, 4, 8, args.input_words, args.output_tokens, scratch / "warm.json")
                print(f"{label}: worker {worker} threads {(health.get('info') or {}).get('cpu_threads')}", flush=True)
            for rep in range(args.repeats):
                for label, _, _ in arms if rep % 2 == 0 else reversed(arms):
                    proc, url, out = servers[label]
                    http_pid, worker = pids[label]
                    os.kill(worker, signal.SIGUSR1)
                    time.sleep(0.2)
                    http_before, load = cpu_s(http_pid), os.getloadavg()[0]
                    run, client_cpu = _bench(url, args.concurrency, args.concurrency, args.input_words,
                                             args.output_tokens, scratch / "run.json")
                    http_cpu = cpu_s(http_pid) - http_before
                    dump = out / f"{worker}-{rep}.json"
                    (out / f"{worker}.json").unlink(missing_ok=True)
                    os.kill(worker, signal.SIGUSR2)
                    while not (out / f"{worker}.json").is_file():
                        time.sleep(0.05)
                    time.sleep(0.2)
                    (out / f"{worker}.json").rename(dump)
                    steps = analyse(json.loads(dump.read_text()), args.concurrency)
                    r = {"load": load, "tpot_ms": run["tpot_ms"]["mean"], "tpot_p50_ms": run["tpot_ms"]["p50"],
                         "ttft_ms": run["ttft_ms"]["mean"], "output_tok_s": run["output_throughput_tok_s"],
                         "http_cpu_ms_per_step": 1e3 * http_cpu / max(1, steps["forwards"]),
                         "client_cpu_ms_per_step": 1e3 * client_cpu / max(1, steps["forwards"]), **steps}
                    r["tpot_over_period"] = r["tpot_ms"] / r["period_ms"]
                    runs[label].append(r)
                    print(f"rep {rep} {label:<8} load {load:5.2f} TPOT {r['tpot_ms']:6.2f} ms  period {r['period_ms']:6.2f}"
                          f"  fwd {r['forward_wall_ms']:6.2f} (cpu {r['forward_cpu_ms']:5.2f})  gap {r['gap_ms']:5.2f}"
                          f"  wait {r['wait_ms_per_step'][0]:5.2f} launch {r['launch_ms_per_step'][0]:5.2f}"
                          f" resolve {r['resolve_ms_per_step'][0]:5.2f} emit {r['emit_ms_per_step'][0]:5.2f}"
                          f"  http cpu {r['http_cpu_ms_per_step']:5.2f} client cpu {r['client_cpu_ms_per_step']:5.2f}"
                          f"  {r['output_tok_s']:6.0f} tok/s", flush=True)
                    print("        threads/forward:", r["threads_per_forward"], flush=True)
        finally:
            for proc, _, _ in servers.values():
                launch.stop(proc)
    keys = ("tpot_ms", "period_ms", "tpot_over_period", "forward_wall_ms", "forward_cpu_ms", "gap_ms",
            "http_cpu_ms_per_step", "client_cpu_ms_per_step", "output_tok_s", "ttft_ms", "load")
    # A run without a plateau of full steps (the requests arrived spread out) has no step figures.
    summary = {label: {k: _median([r[k] for r in rs if r[k] == r[k]]) for k in keys} for label, rs in runs.items() if rs}
    print(f"{'arm':<10}" + "".join(f"{k[:14]:>16}" for k in keys))
    for label, s in summary.items():
        print(f"{label:<10}" + "".join(f"{s[k]:>16.2f}" for k in keys))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "arms": [dict(zip(("label", "flags", "pin"), a)) for a in arms],
                                    "concurrency": args.concurrency, "input_words": args.input_words,
                                    "output_tokens": args.output_tokens, "runs": runs, "summary": summary}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
