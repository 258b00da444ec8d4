"""The worker loop thread's CPU per steady decode step under async scheduling, phase by phase (issue 25:
TPOT at c=32 within 1.3x of the step; the loop thread's Python serialises with the forward's on the GIL).

In process, no HTTP: the 5M Llama (float32, C++ decode attention) driven by ``AsyncScheduling`` as the
worker drives it, ``--batch`` requests (default 32) of ``--prompt-len`` tokens (32) and ``--max-tokens``
outputs (128), each step's outputs encoded as the worker's ``Outputs`` message (server/messages.py).
From outside the product code, the loop thread's methods are wrapped with ``time.thread_time`` stopwatches:
schedule, prepare (``ModelRunner._prepare``), pending rows, commit, resolve (the scheduler's), kv events
and forget (the engine's bookkeeping after a step) and emit (the message encoded); "other" is the rest of
``AsyncScheduling.step`` (sampling settings, the executor hand-off, the future). Only steady steps count:
every scheduled row a decode at the full batch. A second pass of the same run under cProfile (on the
loop thread only) counts the Python function calls per steady step and names the costliest functions.
CPU time, not wall time: the machine is shared. The forward runs on the step thread and is not counted.

    python benchmarks/loop_thread_cpu.py [--quick] [--batch 32] [--repeats 3] [--threads 1] [--before CHECKOUT]

``--before``: an earlier checkout measured too, the two taking turns repeat by repeat (each in a process
of its own, this script copied into it), so that load changes hit both alike.
"""

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine_timing import LLAMA_5M, decode_engine, llama_5m

RESULTS = Path(__file__).resolve().parent / "results" / "loop_thread_cpu.json"
# phase -> (object attribute path from the stepper, method name)
PHASES = {
    "schedule": ("engine.scheduler", "schedule"),
    "prepare": ("runner", "_prepare"),
    "pending_rows": ("", "_pending_rows"),
    "commit": ("engine.scheduler", "commit"),
    "resolve": ("engine.scheduler", "resolve"),
    "kv_events": ("engine", "_publish_kv_events"),
    "forget": ("engine", "_forget_finished"),
    "can_overlap": ("", "_can_overlap"),
}


def _owner(stepper, path: str):
    owner = stepper
    for name in filter(None, path.split(".")):
        owner = getattr(owner, name)
    return owner


class PhaseClock:
    """``time.thread_time`` stopwatches on the loop thread's methods (instance attributes, removed by ``close``)."""

    def __init__(self, stepper) -> None:
        self.stepper = stepper
        self.cpu = dict.fromkeys(PHASES, 0.0)
        for phase, (path, name) in PHASES.items():
            self._wrap(phase, _owner(stepper, path), name)

    def _wrap(self, phase: str, owner, name: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.cpu[phase] += time.thread_time() - start

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        taken, self.cpu = self.cpu, dict.fromkeys(PHASES, 0.0)
        return taken

    def close(self) -> None:
        for path, name in PHASES.values():
            delattr(_owner(self.stepper, path), name)


def _steady(stepper, batch: int) -> bool:
    """Whether the step just launched is a full batch of plain decodes (the one ``step()`` resolves next)."""
    launched = stepper.inflight
    return (launched is not None and len(launched.scheduled) == batch
            and all(s.num_new_tokens == 1 for s in launched.scheduled))


def generate(engine, stepper, batch: int, prompt_len: int, max_tokens: int, tag: str, on_step) -> list[list[int]]:
    """``batch`` greedy requests run to the end through ``stepper``; each step's outputs encoded as the
    worker sends them. ``on_step(steady)`` after each step. Returns each request's tokens (a check that
    every run generates the same)."""
    from xinserve.engines import SamplingParams
    from xinserve.server import messages
    from xinserve.server.messages import Outputs

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [7 + (i * 31 + j * 7) % 500 for j in range(prompt_len)], params)
    tokens: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(batch)}
    while stepper.has_unfinished():
        steady = _steady(stepper, batch)  # the step this call resolves
        start = time.thread_time()
        result = stepper.step()
        emitted = time.thread_time()
        messages.encode(Outputs(result.outputs, None, {}))
        on_step(steady, start, emitted, time.thread_time())
        for out in result.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return list(tokens.values())


def timed_run(engine, stepper, args, tag: str) -> tuple[dict[str, float], int, list[list[int]]]:
    """CPU microseconds per steady step, per phase and in all (the loop thread), and the steady steps."""
    clock = PhaseClock(stepper)
    per_step: list[dict[str, float]] = []

    def on_step(steady: bool, start: float, emitted: float, end: float) -> None:
        phases = clock.take()
        if steady:
            other = emitted - start - sum(phases.values())  # the rest of ``step()``
            per_step.append({**phases, "emit": end - emitted, "other": other, "total": end - start})

    try:
        tokens = generate(engine, stepper, args.batch, args.prompt_len, args.max_tokens, tag, on_step)
    finally:
        clock.close()
    phases = {k: 1e6 * statistics.median(p[k] for p in per_step) for k in per_step[0]}
    return phases, len(per_step), tokens


def profiled_run(engine, stepper, args, tag: str) -> dict:
    """Python function calls per steady step on the loop thread, and the costliest functions."""
    profile = cProfile.Profile(time.thread_time)  # CPU, not the waits for the GIL or the step
    steady_steps = [0]

    def on_step(steady: bool, *_: float) -> None:
        steady_steps[0] += steady

    profile.enable()
    generate(engine, stepper, args.batch, args.prompt_len, args.max_tokens, tag, on_step)
    profile.disable()
    stats = pstats.Stats(profile)
    total_steps = args.max_tokens + 1  # a prefill step, then one step per output token
    top = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:20]  # by own time
    return {
        "calls_per_step": stats.total_calls / total_steps,
        "steady_steps": steady_steps[0],
        "top_own_time": [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_step": v[1] / total_steps,
                          "own_us_per_step": 1e6 * v[2] / total_steps} for (f, line, name), v in top],
    }


def measure(args: argparse.Namespace) -> dict:
    """This checkout's engine, in this process: the runs' phases and profiles."""
    path = llama_5m(args.model_dir)
    import torch

    from xinserve.server.worker import ASYNC_GIL_SWITCH_INTERVAL_S

    torch.set_num_threads(args.threads)
    llm = decode_engine(path, args.batch, args.prompt_len, args.max_tokens, compile=args.compile,
                        kernels={"decode_attention": "cpp"}, warm_up_in_background=False)
    engine = llm.engine
    stepper = engine.async_steps()
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(ASYNC_GIL_SWITCH_INTERVAL_S)  # as the worker's loop sets it
    runs, profiles, reference = [], [], None
    try:
        for rep in range(args.repeats):
            phases, steady, tokens = timed_run(engine, stepper, args, f"t{rep}")
            profile = profiled_run(engine, stepper, args, f"p{rep}")
            reference = reference or tokens
            if tokens != reference:
                raise SystemExit("a repeat generated other tokens than the first")
            runs.append({"phases_us": phases, "steady_steps": steady, "load_average": os.getloadavg()[0]})
            profiles.append(profile)
            print(f"repeat {rep}: {phases['total']:.0f} us CPU per steady step over {steady} steps; "
                  f"{profile['calls_per_step']:.0f} Python calls per step", file=sys.stderr)
    finally:
        sys.setswitchinterval(switch_interval)
        stepper.close()
        llm.close()
    return {"runs": runs, "profiles": profiles}


def measure_elsewhere(root: Path, args: argparse.Namespace, out: Path) -> dict:
    """One repeat of this script run on the checkout at ``root`` (its engines; this script copied in)."""
    script = root / "benchmarks" / Path(__file__).name
    if not script.exists() or script.read_bytes() != Path(__file__).read_bytes():
        shutil.copy(__file__, script)
    command = [sys.executable, str(script), "--repeats", "1", "--batch", str(args.batch), "--prompt-len",
               str(args.prompt_len), "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
               "--compile", args.compile, "--model-dir", args.model_dir, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run(command, check=True, cwd=root, env=env, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["arms"]["this"]


def summarise(arm: dict) -> dict:
    names = [*PHASES, "emit", "other", "total"]
    return {"phases_us": {k: statistics.median(r["phases_us"][k] for r in arm["runs"]) for k in names},
            "python_calls_per_step": statistics.median(p["calls_per_step"] for p in arm["profiles"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 8, 24 tokens, one repeat (a smoke run)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", default="off", help="the engine's compile mode (the loop thread's work is the same)")
    p.add_argument("--before", type=Path, help="another checkout (a git worktree or archive of an earlier "
                   "commit): both measured, one repeat each in turn, in subprocesses")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.max_tokens, args.repeats = 8, 24, 1
    if args.before is None:
        arms = {"this": measure(args)}
    else:
        arms = {"before": {"runs": [], "profiles": []}, "after": {"runs": [], "profiles": []}}
        roots = {"before": args.before.resolve(), "after": Path(__file__).resolve().parents[1]}
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(args.repeats):
                for name in ("before", "after") if rep % 2 == 0 else ("after", "before"):
                    one = measure_elsewhere(roots[name], args, Path(tmp) / f"{name}{rep}.json")
                    arms[name]["runs"] += one["runs"]
                    arms[name]["profiles"] += one["profiles"]
                    print(f"repeat {rep} {name}: {one['runs'][0]['phases_us']['total']:.0f} us", file=sys.stderr)
    summary = {name: summarise(arm) for name, arm in arms.items()}
    print(f"loop thread, batch {args.batch} x {args.prompt_len}-token prompts, {args.max_tokens} outputs "
          f"(load {os.getloadavg()[0]:.1f}): CPU us per steady decode step, median of {args.repeats}")
    print("| phase | " + " | ".join(summary) + " |\n|---|" + "---:|" * len(summary))
    for k in [*PHASES, "emit", "other", "total"]:
        print(f"| {k} | " + " | ".join(f"{s['phases_us'][k]:.1f}" for s in summary.values()) + " |")
    print("| Python calls/step (all steps) | "
          + " | ".join(f"{s['python_calls_per_step']:.0f}" for s in summary.values()) + " |")
    last = list(arms.values())[-1]["profiles"][-1]
    print("\ncostliest functions (own time, profiled run, per step):")
    for f in last["top_own_time"]:
        print(f"  {f['own_us_per_step']:7.1f} us  {f['calls_per_step']:7.1f} calls  {f['function']}")
    result = {"model": LLAMA_5M, "dtype": "float32", "threads": args.threads, "compile": args.compile,
              "batch": args.batch, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "load_average": os.getloadavg(), "summary": summary, "arms": arms}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
