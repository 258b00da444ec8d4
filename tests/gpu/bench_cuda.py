"""The device script of issue 42: one command on one GPU, at most ~6 minutes, one JSON
(benchmarks/results/cuda_bench.json). Sections, each under the time left (a section that would not fit
is recorded as skipped, with why):

1. ``matmul_floor``: one CUDA graph of the model's matmuls alone (qkv, o, gate_up, down per layer), random
   bf16 weights of Llama-3.2-1B and Llama-3-8B layer shapes, at batches 1 / 8 / 32 / 128;
2. ``offline_1b`` (and ``offline_8b``, last: its checkpoint is the largest): decode-only ms/step of the
   engine (graphs on, prefill excluded, a warm-up at each batch) at the same batches, and its ratio to
   the floor;
3. ``buckets``: every captured bucket replays without allocating or syncing (graph_buckets.replay_check),
   and graph vs eager ms/step per bucket at its own batch and at one that pads into it (3 -> 4);
4. ``host_phases``: where a step's host time goes (benchmarks/step_phases.py) against the replay;
5. ``async``: decode ms/step with async scheduling on and off (``async_scheduling_on_accelerators``: its
   default on accelerators is what this measures);
6. ``server``: ``xinserve serve`` on the 1B checkpoint at concurrency 1 / 32 / 128 (TPOT, tok/s) and its
   TPOT at c=1 against the offline step at batch 1.

    python tests/gpu/bench_cuda.py                 # on a GPU lease
    python tests/gpu/bench_cuda.py --cpu-smoke     # tiny shapes on the CPU: the script runs end to end

The random checkpoints go to /dev/shm when it exists (``--model-dir``). Not a pytest test; its smoke run is
tests/benchmarks/test_bench_cuda_smoke.py.
"""

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(Path(__file__).resolve().parent)]

import torch
from graph_buckets import bucket_rows, decode_ms, replay_check
from random_llama import SHAPES, layer_matmuls, matmul_floor_ms, write_checkpoint
from step_phases import step_phases

RESULTS = ROOT / "benchmarks" / "results" / "cuda_bench.json"


@dataclass(frozen=True)
class Plan:
    """What a run measures: the GPU plan, or the CPU smoke run's tiny one."""

    device: str
    dtype: str
    shapes: tuple[str, ...]  # the first is the one the buckets, phases, async and server sections use
    batches: tuple[int, ...]
    prompt_len: int
    steps: int  # timed decode steps per point
    compile: str  # the graphs engine's; the smoke run's CPU engine stays eager (inductor takes minutes)
    concurrency: tuple[int, ...]
    server_prompts: dict[int, int]
    output_tokens: int
    budget_s: float
    estimates_s: dict[str, float]  # a section starts only when this much time is left
    server_flags: tuple[str, ...] = ()


GPU = Plan("cuda:0", "bfloat16", ("llama-3.2-1b", "llama-3-8b"), (1, 8, 32, 128), 128, 30, "on", (1, 32, 128),
           {1: 8, 32: 64, 128: 256}, 128, 330,
           {"matmul_floor": 20, "offline_1b": 40, "buckets": 50, "host_phases": 15, "async": 20, "server": 80,
            "offline_8b": 90})
SMOKE = Plan("cpu", "float32", ("tiny",), (1, 2), 16, 3, "off", (1, 2), {1: 2, 2: 2}, 4, 240,
             {"matmul_floor": 1, "offline_1b": 5, "buckets": 5, "host_phases": 2, "async": 3, "server": 60,
              "offline_8b": 5}, ("--cpu-threads", "1"))
SECTIONS = ("matmul_floor", "offline_1b", "buckets", "host_phases", "async", "server", "offline_8b")


class Budget:
    """The run's time, and the sections chosen (``--sections``)."""

    def __init__(self, total_s: float, sections: set[str]) -> None:
        self.start, self.total_s, self.sections = time.monotonic(), total_s, sections

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start)


def run_section(result: dict, budget: Budget, plan: Plan, name: str, function, *args) -> None:
    """``function(*args)`` as section ``name`` of ``result``, or a skip with its reason."""
    if name not in budget.sections:
        result["sections"][name] = {"status": "skipped", "reason": "not chosen (--sections)"}
        return
    if budget.left() < plan.estimates_s[name]:
        result["sections"][name] = {"status": "skipped", "reason": f"{budget.left():.0f} s left of the "
                                    f"{plan.budget_s:.0f} s budget, the section needs ~{plan.estimates_s[name]:.0f} s"}
        return
    start = time.monotonic()
    try:
        data = function(*args)
        status = "ran"
    except Exception as exc:  # noqa: BLE001  one section failing leaves the others' figures
        data, status = {"error": f"{type(exc).__name__}: {exc}"[:500]}, "failed"
    result["sections"][name] = {"status": status, "seconds": round(time.monotonic() - start, 1), **data}
    print(f"{name}: {status} in {result['sections'][name]['seconds']} s", file=sys.stderr)


def engine(path: Path, plan: Plan, **options):
    from xinserve.engines import LLM

    max_seqs = max(plan.batches)
    blocks = max_seqs * -(-(plan.prompt_len + 2 * plan.steps + 32) // 16) + 64
    return LLM(str(path), device=plan.device, dtype=plan.dtype, max_num_seqs=max_seqs, block_size=16,
               num_kv_blocks=blocks, max_model_len=4096, max_num_batched_tokens=max(4096, plan.prompt_len * 8),
               **{"compile": plan.compile, **options})


def release(*llms) -> None:
    for llm in llms:
        llm.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def floor_section(plan: Plan, dtype: torch.dtype, device: torch.device) -> dict:
    rows = []
    for name in plan.shapes:
        weights = layer_matmuls(SHAPES[name], dtype, device)
        rows += [{"shape": name, "batch": b, "floor_ms": matmul_floor_ms(weights, b, device)} for b in plan.batches]
        del weights
        release()
    return {"rows": rows}


def offline_section(plan: Plan, name: str, path: Path, floors: dict) -> dict:
    llm = engine(path, plan)
    rows = []
    for batch in plan.batches:
        step = decode_ms(llm.engine, batch, plan.prompt_len, plan.steps)
        floor = floors.get((name, batch))
        rows.append({"shape": name, "batch": batch, "step_ms": step, "floor_ms": floor,
                     "step_over_floor": None if floor is None else step / floor})
    graphs = llm.engine.runner.decode_graphs
    release(llm)
    return {"graphs": None if graphs is None else graphs.report(), "rows": rows}


def buckets_section(plan: Plan, path: Path) -> dict:
    graphs_llm, eager_llm = engine(path, plan), engine(path, plan, compile="off")
    graphs = graphs_llm.engine.runner.decode_graphs
    sizes = sorted(graphs.steps) if graphs is not None else list(plan.batches)
    replays = replay_check(graphs) if graphs is not None and torch.cuda.is_available() else []
    rows = bucket_rows(graphs_llm.engine, eager_llm.engine, sizes, plan.prompt_len, plan.steps)
    release(graphs_llm, eager_llm)
    return {"captured": graphs is not None, "replays": replays, "rows": rows,
            "ok": all(r["ok"] for r in replays) and all(r["graphs_over_eager"] <= 1.0 for r in rows)}


def phases_section(plan: Plan, path: Path) -> dict:
    llm = engine(path, plan)
    rows = []
    for batch in (plan.batches[0], plan.batches[-1]):
        with step_phases(llm.engine) as phases:
            decode_ms(llm.engine, batch, plan.prompt_len, plan.steps)
        rows.append({"batch": batch, **phases.per_step_ms()})
    release(llm)
    return {"note": "ms per step, prefill and warm-up steps included; device: the forward's wait", "rows": rows}


def async_section(plan: Plan, path: Path) -> dict:
    llm = engine(path, plan, async_scheduling_on_accelerators=True)
    stepper = llm.engine.async_steps()
    rows = []
    for batch in plan.batches:
        off = decode_ms(llm.engine, batch, plan.prompt_len, plan.steps)
        on = decode_ms(llm.engine, batch, plan.prompt_len, plan.steps, stepper=stepper)
        rows.append({"batch": batch, "sync_ms": off, "async_ms": on, "async_over_sync": on / off})
    stepper.close()
    release(llm)
    faster = all(r["async_over_sync"] < 1.0 for r in rows)
    return {"rows": rows, "async_faster_at_every_batch": faster,
            "recommendation": f"async_scheduling_on_accelerators: {'true' if faster else 'false'}"}


def server_section(plan: Plan, path: Path, scratch: Path, offline_c1_ms: float | None) -> dict:
    from xinserve.server.cli.bench import launch

    port = launch.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "xinserve.server.cli", "serve", "--model", str(path), "--host", "127.0.0.1",
           "--port", str(port), "--device", plan.device, "--dtype", plan.dtype, "--compile", plan.compile,
           "--max-num-seqs", str(max(plan.concurrency)), "--num-kv-blocks", str(max(plan.concurrency) * 24 + 64),
           *plan.server_flags]
    proc = launch.start(cmd, scratch / "server.log", ROOT, {"PYTHONPATH": str(ROOT)})
    rows = []
    try:
        launch.wait_ready(url, proc, scratch / "server.log", timeout=plan.estimates_s["server"])
        for c in plan.concurrency:
            out = scratch / f"bench-c{c}.json"
            bench = [sys.executable, "-m", "xinserve.server.cli", "bench", "--base-url", f"{url}/v1", "--concurrency",
                     str(c), "--num-prompts", str(plan.server_prompts[c]), "--output-tokens", str(plan.output_tokens),
                     "--input-words", str(plan.prompt_len), "--endpoint", "completions", "--json", str(out)]
            done = subprocess.run(bench, cwd=ROOT, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"bench at c={c} failed: {done.stderr[-500:]}")
            run = json.loads(out.read_text())["runs"][0]
            rows.append({"concurrency": c, "requests": plan.server_prompts[c], "failed": run["failed"],
                         "output_tok_s": run["output_throughput_tok_s"], "tpot_ms": run["tpot_ms"],
                         "ttft_ms": run["ttft_ms"]})
    finally:
        launch.stop(proc)
    c1 = rows[0]["tpot_ms"].get("mean") if rows else None
    return {"rows": rows, "offline_step_ms_batch_1": offline_c1_ms,
            "tpot_c1_over_offline_step": None if not (c1 and offline_c1_ms) else c1 / offline_c1_ms}


def environment(device: torch.device) -> dict:
    import triton

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {"device": props.name, "capability": f"sm_{props.major}{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1)}
    else:
        env["device"] = "cpu (smoke run: tiny shapes, figures mean nothing)"
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: the script end to end")
    parser.add_argument("--out", type=Path, default=RESULTS)
    shm = Path("/dev/shm")  # memory: the 8B checkpoint (16 GB) writes and loads in seconds, where it has room
    roomy = shm.is_dir() and shutil.disk_usage(shm).free > 40 << 30
    parser.add_argument("--model-dir", type=Path,
                        default=(shm if roomy else Path(tempfile.gettempdir())) / "xinserve-bench-cuda")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma separated; default: all")
    args = parser.parse_args(argv)
    plan = SMOKE if args.cpu_smoke else GPU
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench_cuda.py needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    budget = Budget(plan.budget_s, set(args.sections.split(",")))
    device, dtype = torch.device(plan.device), getattr(torch, plan.dtype)
    result = {"environment": environment(device), "plan": {"shapes": plan.shapes, "batches": plan.batches,
              "prompt_len": plan.prompt_len, "timed_steps": plan.steps, "budget_s": plan.budget_s},
              "sections": {}}
    sections = result["sections"]
    paths = {name: args.model_dir / f"{name}-{plan.dtype}" for name in plan.shapes}
    first = plan.shapes[0]
    with tempfile.TemporaryDirectory() as scratch, torch.inference_mode():
        run_section(result, budget, plan, "matmul_floor", floor_section, plan, dtype, device)
        floors = {(r["shape"], r["batch"]): r["floor_ms"] for r in sections["matmul_floor"].get("rows", [])}
        try:
            write_checkpoint(paths[first], SHAPES[first], dtype, device)  # ~10 s for the 1B shape
        except Exception as exc:  # noqa: BLE001  the sections that need it fail, each saying so
            result["checkpoint_error"] = f"{type(exc).__name__}: {exc}"[:500]
        run_section(result, budget, plan, "offline_1b", offline_section, plan, first, paths[first], floors)
        run_section(result, budget, plan, "buckets", buckets_section, plan, paths[first])
        run_section(result, budget, plan, "host_phases", phases_section, plan, paths[first])
        run_section(result, budget, plan, "async", async_section, plan, paths[first])
        offline_rows = sections["offline_1b"].get("rows", [])
        c1 = next((r["step_ms"] for r in offline_rows if r["batch"] == 1), None)
        run_section(result, budget, plan, "server", server_section, plan, paths[first], Path(scratch), c1)
        if len(plan.shapes) > 1:
            second = plan.shapes[1]
            run_section(result, budget, plan, "offline_8b", lambda: offline_section(
                plan, second, write_checkpoint(paths[second], SHAPES[second], dtype, device), floors))
        else:
            sections["offline_8b"] = {"status": "skipped", "reason": "the CPU smoke plan has one (tiny) shape"}
    result["seconds"] = round(plan.budget_s - budget.left(), 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps(result, indent=2, default=str))
    return 0 if all(s["status"] != "failed" for s in sections.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
