"""Embeddings per second against the batch size (inputs per /v1/embeddings request: 1, 8, 32, 128) on
a tiny random Qwen3 embedding model (the 5M shape of the other scripts: hidden 256, 4 layers; last-token
pooling and normalize, Qwen3-Embedding's recipe), served by ``xinserve serve --runner pooling`` on one
CPU worker and driven by ``xinserve bench --endpoint embeddings`` (one request in flight; 16 requests
of 16 random words per input at each batch size). Prints the table and writes
``benchmarks/results/embeddings.json``. The server is started from this checkout. The committed result:

    python benchmarks/embeddings.py

Smoke run: ``python benchmarks/embeddings.py --quick --out /tmp/embeddings.json`` (batch sizes 1 and 8,
4 requests each).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import LLAMA_5M, ROOT, lscpu, script_args, write_result

from xinserve.server.cli.bench import launch


def build_model(model_dir: str) -> str:
    from xinserve.server.embedded_model.factory import make_tiny_model

    path = Path(model_dir) / "qwen3-embed-5m"
    if not (path / "config.json").is_file():
        make_tiny_model(path, "qwen3", **LLAMA_5M)
    return str(path)


def main() -> int:
    parser = script_args(__doc__, "embeddings.json", quick_help="batch sizes 1 and 8, 4 requests each")
    args = parser.parse_args()
    model = build_model(args.model_dir)
    port = launch.free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="xinserve-embeddings-")) / "server.log"
    env = {"PYTHONPATH": str(ROOT), "XINSERVE_COMPILE": "off"}
    proc = launch.start([sys.executable, "-m", "xinserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                         "--model", model, "--runner", "pooling", "--max-num-batched-tokens", "8192"], log, ROOT, env)
    out = Path(tempfile.mkdtemp(prefix="xinserve-embeddings-")) / "bench.json"
    try:
        launch.wait_ready(url, proc, log)
        bench = [sys.executable, "-m", "xinserve.server.cli", "bench", "--base-url", f"{url}/v1", "--endpoint",
                 "embeddings", "--batch-size", "1,8" if args.quick else "1,8,32,128", "--num-prompts",
                 "4" if args.quick else "16", "--input-words", "16", "--json", str(out)]
        done = subprocess.run(bench, cwd=ROOT, env={**os.environ, **env}, check=False)
    finally:
        launch.stop(proc)
    if done.returncode != 0:
        print(f"xinserve bench failed ({done.returncode}); server log: {log}")
        return 1
    result = json.loads(out.read_text())
    write_result(args.out, {"model": LLAMA_5M | {"arch": "qwen3", "pooling": "lasttoken + normalize"},
                            "cpu": lscpu().get("Model name"), "cpus": os.cpu_count(), "runs": result["runs"]})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
