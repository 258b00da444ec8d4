"""What the benchmark scripts share: the machine, their command line, their results, the engine's clocks.

- ``lscpu``: the CPU a result was measured on (model name, cores, flags: compile times and kernels
  differ between AVX2 and AVX-512 machines);
- ``script_args``: the options every engine script takes (``--model-dir``, ``--out``, ``--quick``);
- ``write_result`` and ``markdown_table``: the JSON under ``benchmarks/results/`` and the printed table;
- ``LLAMA_5M`` and ``llama_5m``: the random 5M-parameter Llama most scripts measure (hidden 256, 4 layers,
  4 heads / 2 KV heads, context 2048), built locally once;
- ``StepClock`` and ``forward_clock``: an engine's step and its runner's forward seen through a stopwatch
  from outside (production code carries no timer);
- ``decoding`` and ``decode_engine``: steady decode steps of a batch at a given context;
- ``collectives_per_step``: decode steps of a parallel engine timed per batch, with the collectives each
  step issued;
- ``default_server``, ``poll_health``, ``decode_graphs`` and ``tree_cpu_seconds``: the default ``xinserve
  serve`` started on caches of the script's choosing, its /health milestones and its processes' CPU time
  (``cold_start.py``, ``warm_start.py``).

A sibling module of the scripts (``python benchmarks/X.py`` puts this folder on ``sys.path``).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from xinserve.engines.core.outputs import StepResult

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LLAMA_5M = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}


def lscpu() -> dict[str, str]:
    """``lscpu``'s model name, CPU count and flags; empty where there is no lscpu."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in fields.items() if k.strip() in ("Model name", "CPU(s)", "Flags")}


def script_args(doc: str, result_name: str, quick_help: str | None = None) -> argparse.ArgumentParser:
    """A parser with the options every engine script takes: ``--model-dir`` (where the models are built
    once), ``--out`` (default ``benchmarks/results/RESULT_NAME``) and, given its help, ``--quick``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if quick_help:
        parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS / result_name)
    return parser


def write_result(path: Path, result: dict[str, Any]) -> None:
    """``result`` as indented JSON at ``path`` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def markdown_table(headings: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(headings) + " |", "|---|" + "---:|" * (len(headings) - 1)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


class StepClock:
    """Stands in for an engine: ``step()`` is timed (``seconds``, ``steps``), the rest passes through."""

    def __init__(self, engine) -> None:
        self.engine, self.seconds, self.steps = engine, 0.0, 0

    def step(self) -> "StepResult":
        start = time.perf_counter()
        outputs = self.engine.step()
        self.seconds += time.perf_counter() - start
        self.steps += 1
        return outputs

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


@dataclass
class Clock:
    seconds: float = 0.0


@contextmanager
def forward_clock(runner) -> Iterator[Clock]:
    """While open, ``Clock.seconds`` sums the wall time of ``runner.forward`` (the decoder plus the
    logits, waited for on the device): a wrapper set on the runner instance, removed on exit."""
    clock, forward = Clock(), runner.forward

    def timed(batch):
        start = time.perf_counter()
        logits = forward(batch)
        runner.platform.synchronize()
        clock.seconds += time.perf_counter() - start
        return logits

    runner.forward = timed
    try:
        yield clock
    finally:
        del runner.forward  # back to the class's method


@contextmanager
def decoding(engine, batch: int, context: int, steps: int) -> Iterator[None]:
    """``batch`` sequences of ``context`` prompt tokens, prefilled and 4 decode steps in, with
    ``steps`` more tokens to go; aborted on exit."""
    from xinserve.engines import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8 + steps, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{batch}-{context}-{i}", [7 + (i * 31 + j * 7) % 900 for j in range(context)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    try:
        yield
    finally:
        for request_id in list(engine.requests):
            engine.abort_request(request_id)


def llama_5m(model_dir: str) -> str:
    """The 5M Llama's directory (built once), with the engine importable and torch on one thread."""
    sys.path.insert(0, str(ROOT))
    import torch

    from xinserve.server.embedded_model.factory import ensure_tiny_model

    torch.set_num_threads(1)
    return str(ensure_tiny_model(model_dir, name="llama-5m", **LLAMA_5M))


def decode_engine(path: str, max_num_seqs: int, max_context: int, steps: int, **options):
    """An ``LLM`` of ``path`` in float32 with KV blocks of 16 tokens for ``max_num_seqs`` sequences of
    ``max_context`` prompt tokens and ``steps`` decode steps (``decoding``'s), plus ``options``."""
    from xinserve.engines import LLM

    num_blocks = max_num_seqs * -(-(max_context + 8 + steps) // 16) + 16
    return LLM(path, dtype="float32", num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs, block_size=16,
               max_num_batched_tokens=4096, **options)


def collectives_per_step(engine, batches: tuple[int, ...], prompt_len: int, warm_steps: int, window: int,
                         windows: int) -> Iterator[tuple[int, float, dict[str, float]]]:
    """Per batch size: (batch, best milliseconds per step over ``windows`` windows of ``window`` decode
    steps, each collective's count per step in the last window; empty on one device). The batch's
    requests are added, warmed up for ``warm_steps`` steps, timed, then aborted."""
    from xinserve.engines import SamplingParams

    group = getattr(engine.runner, "group", None)
    params = SamplingParams(temperature=0, max_tokens=warm_steps + windows * window + 8, ignore_eos=True)
    for batch in batches:
        for i in range(batch):
            engine.add_request(f"{batch}-{i}", [7 + (i * 31 + j * 7) % 900 for j in range(prompt_len)], params)
        for _ in range(warm_steps):
            engine.step()
        best, counts = None, {}
        for _ in range(windows):
            before = dict(group.counts) if group else {}
            start = time.perf_counter()
            for _ in range(window):
                engine.step()
            step = (time.perf_counter() - start) / window
            best = step if best is None else min(best, step)
            if group:
                counts = {k: (v - before.get(k, 0)) / window for k, v in group.counts.items()}
        yield batch, 1e3 * best, counts
        for request_id in list(engine.requests):
            engine.abort_request(request_id)


def cache_env(cache: Path, compile_off: bool) -> dict[str, str]:
    """This environment with every cache a server fills under ``cache`` (the embedded model, inductor, the
    decode buckets, a C++ kernel build), this checkout importable, no API key, and the default compile mode
    (``off`` if asked). The C++ kernels are the install's build where it has one for this CPU
    (kernels/cpu/cpp_build.py: make's install step makes it), as a user's server finds them; else they are
    built into ``cache`` too."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XINSERVE_CACHE_DIR": str(cache / "xinserve"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    env.pop("TORCH_EXTENSIONS_DIR", None)  # set, it would be the one place the kernels are looked for
    env.pop("XINSERVE_COMPILE", None)  # the default mode, as a user gets it
    env.pop("XINSERVE_API_KEY", None)
    if compile_off:
        env["XINSERVE_COMPILE"] = "off"
    return env


@contextmanager
def default_server(cache: Path, compile_off: bool, flags: Sequence[str] = (),
                   env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, str, float]]:
    """The default ``xinserve serve`` (the embedded model) plus ``flags`` on the caches under ``cache``
    (``cache_env``, then ``env``), its log in ``cache``: (the process, its base URL, its ``perf_counter``
    start). Stopped on exit, with whatever it left running (a C++ build's compiler)."""
    from xinserve.server.cli.bench.launch import free_port

    port = free_port()
    log = (cache / f"server-{port}.log").open("w")
    start = time.perf_counter()
    # A session of its own: what the server leaves running is stopped with it.
    proc = subprocess.Popen([sys.executable, "-m", "xinserve.server.cli", "serve", "--port", str(port), *flags],
                            env={**cache_env(cache, compile_off), **(env or {})}, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)
    try:
        yield proc, f"http://127.0.0.1:{port}", start
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:  # a loaded machine: the figures taken still count
            proc.kill()
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing left
            pass
        log.close()


def poll_health(client: httpx.Client, base: str, start: float, timeout: float, done,
                proc: subprocess.Popen | None = None) -> dict:
    """/health's JSON once ``done(status code, JSON)`` holds, polled every 0.2 s; TimeoutError ``timeout``
    seconds after ``start`` (a ``perf_counter`` time), RuntimeError once ``proc`` (the server) has exited."""
    while time.perf_counter() - start < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} (its log is in the cache directory)")
        try:
            response = client.get(f"{base}/health")
            health = response.json()
            if done(response.status_code, health):
                return health
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no milestone within {timeout:.0f} s")


def decode_graphs(health: dict) -> dict:
    """The first worker's ``info.decode_graphs`` (the default config has one worker)."""
    workers = health.get("workers") or []
    return ((workers[0].get("info") or {}).get("decode_graphs") or {}) if workers else {}


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid``, its live descendants and their reaped children (utime + stime + cutime +
    cstime from /proc/PID/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        # after the command: state, ppid, ..., utime (14th field of the line), stime, cutime, cstime
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(value) for value in fields[11:15])
    tree, grew = {pid}, True
    while grew:
        children = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return round(sum(times.get(p, 0) for p in tree) / tick, 2)
