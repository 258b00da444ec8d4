"""Before/after serving benchmark of two (or more) xinserve checkouts on one machine, interleaved.

Each arm is a checkout served from its own root (``python -m xinserve.server.cli serve`` with that root first
on ``PYTHONPATH``; ``--extra-path`` adds a folder of extra packages to one more arm). Every arm is
started once and kept up; the load levels then run arm after arm, in alternating order each repeat,
so a machine whose load drifts (a shared one) shifts both sides alike. Reported: output tok/s, mean
TTFT and TPOT per arm, their medians over the repeats, and each arm's throughput as a ratio of the
first arm's. Writes benchmarks/results/server_path_ab.json.

Run: python benchmarks/server_path_ab.py --before /work/main --after . [--extra-path DIR]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xinserve.server.bench import launch
from xinserve.server.bench.cli import machine
from xinserve.server.embedded_model.factory import ensure_tiny_model

LLAMA_5M = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}


def _arms(args: argparse.Namespace) -> list[tuple[str, Path, str | None]]:
    """(label, checkout root, PYTHONPATH or None for none)."""
    arms = [("before", args.before.resolve(), None), ("after", args.after.resolve(), str(args.after.resolve()))]
    if args.extra_path:
        arms.append(("after+extra", args.after.resolve(), f"{args.after.resolve()}:{args.extra_path}"))
    return arms


def _start(label: str, root: Path, pythonpath: str | None, model: Path, scratch: Path, dtype: str):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    port = launch.free_port()
    cmd = [sys.executable, "-m", "xinserve.server.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype]
    log = scratch / f"{label}.log"
    with open(log, "wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log


def _bench(url: str, concurrency: int, words: int, prompts: int, tokens: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "xinserve.server.cli", "bench", "--base-url", f"{url}/v1", "--concurrency", str(concurrency),
           "--num-prompts", str(prompts), "--output-tokens", str(tokens), "--input-words", str(words),
           "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    run = json.loads(out.read_text())["runs"][0]
    return {"output_tok_s": run["output_throughput_tok_s"], "ttft_ms": run["ttft_ms"]["mean"],
            "tpot_ms": run["tpot_ms"]["mean"], "failed": run["failed"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, default=Path("/work/main"))
    p.add_argument("--after", type=Path, default=ROOT)
    p.add_argument("--extra-path", help="a folder of extra packages: a third arm, 'after' with it on PYTHONPATH")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--input-words", default="32,512")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "server_path_ab.json")
    args = p.parse_args(argv)
    levels = [(w, c) for w in map(int, args.input_words.split(",")) for c in map(int, args.concurrency.split(","))]
    arms = _arms(args)
    with tempfile.TemporaryDirectory(prefix="xinserve-ab-") as tmp:
        scratch = Path(tmp)
        model = ensure_tiny_model(scratch, "llama-h256-l4", **LLAMA_5M)
        procs = {label: _start(label, root, pp, model, scratch, args.dtype) for label, root, pp in arms}
        results: dict[str, dict[str, list[dict]]] = {label: {} for label, _, _ in arms}
        try:
            for label, (proc, url, log) in procs.items():
                launch.wait_ready(url, proc, log, timeout=1800)
                _bench(url, 4, 32, 8, args.output_tokens, scratch / "warm.json")  # first-call costs out
            for rep in range(args.repeats):
                order = list(procs) if rep % 2 == 0 else list(reversed(procs))
                for words, conc in levels:
                    for label in order:
                        _, url, _ = procs[label]
                        prompts = max(4, conc)
                        r = _bench(url, conc, words, prompts, args.output_tokens, scratch / "run.json")
                        results[label].setdefault(f"{words}w c={conc}", []).append(r)
                        print(f"rep {rep} {words:>3}w c={conc:<2} {label:<12} {r['output_tok_s']:8.1f} tok/s "
                              f"TTFT {r['ttft_ms']:8.1f} ms TPOT {r['tpot_ms']:7.1f} ms", flush=True)
                    _write(args, arms, results, None)  # what is done so far survives an interrupted run
        finally:
            for proc, _, _ in procs.values():
                launch.stop(proc)
    _write(args, arms, results, _summary(results, [label for label, _, _ in arms]))
    print(f"wrote {args.out}")
    return 0


def _write(args: argparse.Namespace, arms: list, results: dict, table: dict | None) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "load_average": os.getloadavg(), "arms": [
        {"label": label, "root": str(root), "pythonpath": pp} for label, root, pp in arms],
        "output_tokens": args.output_tokens, "runs": results, "summary": table}, indent=2))


def _summary(results: dict[str, dict[str, list[dict]]], labels: list[str]) -> dict[str, dict]:
    """Medians per arm and level, and each arm's throughput over the first arm's; prints the table."""
    first, table = labels[0], {}
    print(f"{'level':<12}" + "".join(f"{label + ' tok/s':>20}{'TTFT ms':>10}{'TPOT ms':>10}" for label in labels)
          + "".join(f"{label + '/' + first:>18}" for label in labels[1:]))
    for level in results[first]:
        row = {label: {k: statistics.median(r[k] for r in results[label][level])
                       for k in ("output_tok_s", "ttft_ms", "tpot_ms")} for label in labels}
        for label in labels[1:]:
            row[label]["ratio"] = row[label]["output_tok_s"] / row[first]["output_tok_s"]
        table[level] = row
        print(f"{level:<12}" + "".join(f"{row[x]['output_tok_s']:>20.1f}{row[x]['ttft_ms']:>10.1f}{row[x]['tpot_ms']:>10.1f}"
                                       for x in labels) + "".join(f"{row[x]['ratio']:>18.2f}" for x in labels[1:]))
    return table


if __name__ == "__main__":
    raise SystemExit(main())
