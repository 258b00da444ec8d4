"""An engine is ready before anything that compiles is imported: the CPU buckets compile in a child
process (engines/compile/child.py) and the worker imports dynamo and inductor only to load the first
compiled bucket, in the background warm-up, after ready; and building the model on
the meta device runs no op through ``torch._refs`` (whose first use imports dynamo). Together these
imports cost seconds of CPU in every worker's start (cProfile of a cold worker start)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# Run in a fresh interpreter (this one has imported dynamo in other tests): build a compiling engine
# whose background warm-up is held on an event, so it cannot import anything, and report what the
# engine's constructor imported by itself.
PROBE = """
import json, sys, threading
import xinserve.engines.worker.warmup
held = threading.Event()
xinserve.engines.worker.warmup.Warmup._run = lambda self: held.wait()
from xinserve.engines import LLM
llm = LLM(sys.argv[1], compile="on", warm_up_in_background=True, block_size=4, num_kv_blocks=40,
          max_num_seqs=4, max_model_len=64, kernels={"decode_attention": "reference"})
report = llm.engine.warmup.report()
print(json.dumps({"modules": sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules),
                  "settled": report["settled"], "states": sorted(set(b["state"] for b in report["buckets"].values()))}))
"""


def test_an_engine_is_ready_before_dynamo_or_inductor_is_imported(tiny_models) -> None:
    model = tiny_models("llama", num_layers=1, max_position_embeddings=64)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROBE, str(model)], check=False, capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"modules": [], "settled": False, "states": ["eager"]}
