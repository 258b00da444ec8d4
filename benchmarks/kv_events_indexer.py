"""Our KV events against a third-party prefix-aware indexer: NVIDIA Dynamo's standalone KV indexer
(``python -m dynamo.indexer`` from the ``ai-dynamo-runtime`` wheel), which subscribes to vLLM's ZMQ
events and answers "how many of this prompt's tokens does each worker hold?".

An interoperability check, not a test: ai-dynamo-runtime pins pydantic <= 2.13.5, older than the
server's, so it lives in its own environment. Install it there (or unpack the wheel) and point
``--indexer-python`` / ``--indexer-path`` at it. The script runs the offline engine (the 5M Llama) with
``kv_events_config``, starts the indexer subscribed to it, and asks the indexer about a prompt after
it ran (all its full blocks should be matched), after two other prompts evicted it (none), and about
one of those (its full blocks). Prints a table and writes benchmarks/results/kv_events_indexer.json.

    python -m venv /tmp/dyn && /tmp/dyn/bin/pip install ai-dynamo-runtime
    PYTHONPATH=. python benchmarks/kv_events_indexer.py --indexer-python /tmp/dyn/bin/python
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from engine_timing import llama_5m

RESULTS = Path(__file__).resolve().parent / "results" / "kv_events_indexer.json"
BLOCK = 16


def query(port: int, tokens: list[int]) -> int:
    """The longest match, in tokens, the indexer reports for ``tokens`` on any worker (0: none)."""
    body = json.dumps({"token_ids": tokens, "model_name": "default"}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/query", data=body,
                                     headers={"content-type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request, timeout=5).read())
    return max((w["longest_matched"] for w in answer.get("instances", {}).values()), default=0)


def settle(port: int, tokens: list[int], want: int, timeout_s: float = 30.0) -> int:
    """Poll the indexer until it reports ``want`` for ``tokens`` (events arrive asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = query(port, tokens)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--indexer-python", default=sys.executable, help="an interpreter with ai-dynamo-runtime")
    parser.add_argument("--indexer-path", help="PYTHONPATH for the indexer (an unpacked wheel)")
    parser.add_argument("--port", type=int, default=8097, help="the indexer's HTTP port")
    parser.add_argument("--zmq-port", type=int, default=5611, help="our KV-event PUB port")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    path = llama_5m(args.model_dir)
    env = {**os.environ, **({"PYTHONPATH": args.indexer_path} if args.indexer_path else {})}
    indexer = subprocess.Popen([args.indexer_python, "-m", "dynamo.indexer", "--block-size", str(BLOCK),
                                "--port", str(args.port), "--threads", "1",
                                "--workers", f"1=tcp://127.0.0.1:{args.zmq_port}"], env=env)
    from xinserve.engines import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = [(7 * i) % 250 + 3 for i in range(70)]  # 4 full blocks
    others = [[(11 * i + k) % 250 + 3 for i in range(100)] for k in (0, 100)]  # 6 full blocks each
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{args.zmq_port}"}
    rows = []
    try:
        with LLM(path, dtype="float32", num_kv_blocks=8, block_size=BLOCK, kv_events_config=config) as llm:
            for i in range(100):  # until the indexer's subscription has joined (a PUB drops what precedes it)
                probe = [500 + i] * BLOCK * 2
                llm.generate(probe, params)
                if settle(args.port, probe, 2 * BLOCK, timeout_s=0.5) == 2 * BLOCK:
                    break
            llm.generate(prompt, params)
            rows.append(("prompt after it ran", 4 * BLOCK, settle(args.port, prompt, 4 * BLOCK)))
            for other in others:
                llm.generate(other, params)
            rows.append(("prompt after two others evicted it", 0, settle(args.port, prompt, 0)))
            rows.append(("the last of those", 6 * BLOCK, settle(args.port, others[1], 6 * BLOCK)))
    finally:
        indexer.terminate()
        indexer.wait(10)
    print(f"{'query':<36} {'expected':>9} {'indexer':>8}")
    for name, want, got in rows:
        print(f"{name:<36} {want:>9} {got:>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"indexer": "ai-dynamo-runtime standalone KV indexer", "block_size": BLOCK,
                                    "rows": [{"query": n, "expected_tokens": w, "matched_tokens": g}
                                             for n, w, g in rows]}, indent=2) + "\n")
    print(f"wrote {args.out}")
    if any(want != got for _, want, got in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
