"""CPU seconds per phase of a cold start of the default ``xinserve serve`` (the embedded tiny model on
the CPU), each phase in a fresh interpreter where it would run in a fresh process, so the figures do
not depend on the machine's load the way wall-clock seconds do. Caches are fresh temporary
directories ($XINSERVE_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, TORCH_EXTENSIONS_DIR).

Phases: the HTTP process's imports (``xinserve.server.app``), building the embedded model (in the HTTP process
with ``llama_files.py``; in a checkout without it, ``--before CHECKOUT``, the former spawned builder: a
fresh interpreter importing the factory's transformers model classes), the HTTP process's tokenizer
load, the worker's imports, and
the worker's engine construction split by cProfile (process CPU time) into tokenizer, model load,
kernel probing, KV sizing (the eager warm-up forward), decode-graph set-up and the rest. Writes
``benchmarks/results/cold_start_profile.json``; ``benchmarks/cold_start.py`` measures the seconds to
/health 200 and the whole server's CPU seconds.

    python benchmarks/cold_start_profile.py [--before OLDER_CHECKOUT]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "cold_start_profile.json"

# Each snippet prints one JSON object of CPU seconds (time.process_time) on its last line.
HTTP_IMPORTS = """
import json, time
start = time.process_time()
import xinserve.server.app
print(json.dumps({"http_imports": time.process_time() - start}))
"""
EMBEDDED_BUILD = """
import json, sys, time
import xinserve.server.app # already imported by the HTTP process when it builds
from xinserve.server.embedded_model.llama_files import write_llama
from xinserve.server.pool import load_tokenizer
start = time.process_time()
write_llama(sys.argv[1])
built = time.process_time()
load_tokenizer(sys.argv[1])
print(json.dumps({"embedded_build": built - start, "http_tokenizer_load": time.process_time() - built}))
"""
# What server/embedded.py did before llama_files.py: a spawned child importing the factory (every model
# class); the spawn's own import of the parent's main module (xinserve.server.cli) is not counted.
FACTORY_BUILD = """
import json, sys, time
start = time.process_time()
from xinserve.server.embedded_model.factory import make_tiny_model
imported = time.process_time()
make_tiny_model(sys.argv[1])
print(json.dumps({"factory_imports": imported - start, "factory_build": time.process_time() - imported}))
"""
# The background warm-up (C++ build, bucket compiles) comes after ready: held, it starts nothing.
WORKER = """
import cProfile, json, pstats, sys, threading, time
start = time.process_time()
import torch, zmq
import xinserve.server.worker
from xinserve.engines import EngineConfig, LLMEngine
import xinserve.engines.engine
import xinserve.engines.warmup
imported = time.process_time()
held = threading.Event()
xinserve.engines.warmup.Warmup._run = lambda self: held.wait()
torch.set_num_threads(1)
from xinserve.server.config import default_config_path, load_config
settings = load_config(default_config_path()).models[0]
profile = cProfile.Profile(time.process_time)
profile.enable()
engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", **{**settings.engine_kwargs(), "tokenizer": sys.argv[1]}))
profile.disable()
total = time.process_time() - imported
stats = pstats.Stats(profile).stats  # (file, line, function) -> (calls, primitive, tottime, cumtime, callers)
def cum(file_suffix, function):
    return sum(v[3] for (f, _, name), v in stats.items() if f.endswith(file_suffix) and name == function)
profiled = cum("engines/engine.py", "__init__")
parts = {
    "engine_tokenizer": cum("tokenization_auto.py", "from_pretrained"),
    "engine_model_load": cum("engines/models/loader.py", "load_model"),
    "engine_kernel_probing": cum("kernels/registry.py", "select"),
    "engine_kv_sizing_eager_forward": cum("engines/engine.py", "_profile_num_blocks"),
    "engine_decode_graphs_setup": cum("engines/runner.py", "init_decode_graphs"),
    "engine_warmup_start": cum("engines/warmup.py", "__init__"),
}
# cProfile slows Python code more than C code: scale each part to the unprofiled total.
scale = total / profiled if profiled else 1.0
result = {"worker_imports": imported - start, "engine_construction": total}
result.update({name: seconds * scale for name, seconds in parts.items()})
result["engine_other"] = total - sum(result[name] for name in parts)
result["dynamo_imported_before_ready"] = "torch._dynamo" in sys.modules
print(json.dumps(result))
"""


def run(snippet: str, env: dict[str, str], cwd: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", snippet, *args], capture_output=True, text=True, env=env,
                          cwd=cwd, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def profile(checkout: Path) -> dict:
    """CPU seconds per phase of ``checkout``'s cold start, on fresh caches."""
    with tempfile.TemporaryDirectory(prefix="xinserve-cold-profile-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(checkout), "XINSERVE_CACHE_DIR": f"{tmp}/xinserve",
               "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor", "TORCH_EXTENSIONS_DIR": f"{tmp}/extensions"}
        env.pop("XINSERVE_COMPILE", None)  # the default mode, as a user gets it
        model = f"{tmp}/xinserve-tiny"
        phases = run(HTTP_IMPORTS, env, checkout)
        in_process = (checkout / "server" / "embedded_model" / "llama_files.py").is_file()
        phases.update(run(EMBEDDED_BUILD if in_process else FACTORY_BUILD, env, checkout, model))
        phases.update(run(WORKER, env, checkout, model))
    flags = {k: v for k, v in phases.items() if isinstance(v, bool)}
    return {"cpu_seconds": {k: round(v, 2) for k, v in phases.items() if not isinstance(v, bool)}, **flags}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="an older checkout to profile too (e.g. a git worktree)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = {"after": profile(REPO)}
    if args.before:
        results["before"] = profile(args.before.resolve())
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    names = list(dict.fromkeys(name for result in results.values() for name in result["cpu_seconds"]))
    print(f"| phase | {' | '.join(results)} |\n|---|{'---|' * len(results)}")
    for name in names:
        print(f"| {name} | {' | '.join(str(r['cpu_seconds'].get(name, '')) for r in results.values())} |")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({**results, "load_average_1_5_15": load, "python": sys.version.split()[0]},
                                      indent=1))


if __name__ == "__main__":
    main()
