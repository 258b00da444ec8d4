"""What an engine imports before it is ready. Eager (``compile: off``): nothing that compiles — building
the model on the meta device runs no op through ``torch._refs`` (whose first use imports dynamo); these
imports cost seconds of CPU in every worker's start (cProfile of a cold worker start). Compiling on the
CPU: the buckets compile in a child process (engines/compile/child.py), and the worker imports dynamo
and inductor before ready (``artifacts.prepare_loading``), so that loading the first compiled bucket
after ready costs a serving worker tens of ms, not seconds of GIL-holding imports beside its steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# Run in a fresh interpreter (this one has imported dynamo in other tests): build an engine whose
# background warm-up is held on an event, so it cannot import anything, and report what the engine's
# constructor imported by itself.
PROBE = """
import json, sys, threading
import xinserve.engines.worker.warmup
held = threading.Event()
xinserve.engines.worker.warmup.Warmup._run = lambda self: held.wait()
from xinserve.engines import LLM
llm = LLM(sys.argv[1], compile=sys.argv[2], warm_up_in_background=True, block_size=4, num_kv_blocks=40,
          max_num_seqs=4, max_model_len=64, kernels={"decode_attention": "reference"})
report = llm.engine.warmup.report()
modules = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
import torch._inductor.config
print(json.dumps({"modules": modules,
                  "settled": report["settled"], "states": sorted(set(b["state"] for b in report["buckets"].values())),
                  "compile_threads": torch._inductor.config.compile_threads}))
"""


@pytest.mark.parametrize(("compile_mode", "modules", "states"), [
    ("off", [], []),
    ("on", ["torch._dynamo", "torch._inductor"], ["eager"]),
])
def test_what_an_engine_imports_before_ready(tiny_models, compile_mode, modules, states) -> None:
    model = tiny_models("llama", num_layers=1, max_position_embeddings=64)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROBE, str(model), compile_mode], check=False, capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["modules"] == modules and report["states"] == states
    assert report["settled"] == (compile_mode == "off")
    if compile_mode == "on":
        assert report["compile_threads"] == 1  # the worker never starts inductor's compile pool
