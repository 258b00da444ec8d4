"""Steady-state decode step of the engine: wall time, model forward, and the overhead between.

For each model (the 3.6M-parameter Llama of DESIGN.md and the 33M one of offline_throughput.py)
and batch 1, 8 and 32 (128-token prompts, greedy, ignore_eos), the engine first decodes a few
steps, then times windows of ``engine.step()``. The forward (decoder plus logits) is timed by
wrapping the model's ``forward`` and ``compute_logits``, so the script measures any checkout of the
engine the same way: ``--compare DIR`` runs this tree and the engine in DIR alternately, in fresh
processes, and keeps each side's fastest window (on a shared machine the minimum is the least
disturbed estimate). Prints a markdown table and writes ``benchmarks/results/decode_step.json``.

    python benchmarks/decode_step.py
    mkdir /tmp/before && git archive REV | tar -x -C /tmp/before   # REV: the commit to compare with
    python benchmarks/decode_step.py --compare /tmp/before
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "decode_step.json"
MODELS = {
    "llama-3.6m": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2},
    "llama-30m": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
                  "intermediate_size": 1536, "vocab_size": 8000},
}
BATCHES = (1, 8, 32)
PROMPT_LEN, WARM_STEPS, WINDOW = 128, 4, 10


def measure(model_path: str, windows: int) -> dict[int, tuple[float, float]]:
    """In this process (the engine on sys.path): batch -> (step s, forward s) of the best window."""
    import torch

    from xinserve.engines import LLM, SamplingParams

    num_blocks = max(BATCHES) * 24 + 8  # room for every sequence's 128 + up to 256 tokens
    llm = LLM(model_path, num_kv_blocks=num_blocks, max_num_seqs=max(BATCHES), block_size=16)
    engine, model = llm.engine, llm.engine.runner.model
    forward_s = [0.0]

    def timed(fn):
        def wrapper(*args):
            start = time.perf_counter()
            out = fn(*args)
            forward_s[0] += time.perf_counter() - start
            return out

        return wrapper

    model.forward, model.compute_logits = timed(model.forward), timed(model.compute_logits)
    params = SamplingParams(temperature=0, max_tokens=WARM_STEPS + windows * WINDOW + 8, ignore_eos=True)
    best = {}
    with torch.inference_mode():
        for batch in BATCHES:
            for i in range(batch):
                prompt = [7 + (i * 31 + j * 7) % 900 for j in range(PROMPT_LEN)]
                engine.add_request(f"{batch}-{i}", prompt, params)
            for _ in range(WARM_STEPS):  # prefill, then a few decodes
                engine.step()
            for _ in range(windows):
                forward_s[0] = 0.0
                start = time.perf_counter()
                for _ in range(WINDOW):
                    engine.step()
                step = (time.perf_counter() - start) / WINDOW
                if batch not in best or step < best[batch][0]:
                    best[batch] = (step, forward_s[0] / WINDOW)
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
    return best


def run_worker(tree: Path, model_path: str, windows: int, threads: int) -> dict[int, tuple[float, float]]:
    """``measure`` in a fresh process that imports the engine from ``tree``."""
    command = [sys.executable, __file__, "--worker", str(tree), model_path, str(windows), str(threads)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ""}
    out = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, check=True).stdout
    return {int(k): tuple(v) for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def worker_main(tree: str, model_path: str, windows: str, threads: str) -> None:
    sys.path.insert(0, tree)  # this checkout's engine, whatever else is installed
    import torch

    torch.set_num_threads(int(threads))
    print(json.dumps(measure(model_path, int(windows))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", type=Path, help="another checkout, measured alternately with this one")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per side and model")
    parser.add_argument("--windows", type=int, default=8, help=f"timed windows of {WINDOW} steps per batch")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from xinserve.server.embedded_model.factory import ensure_tiny_model

    trees = {"this": ROOT} | ({"compare": args.compare.resolve()} if args.compare else {})
    rows = []
    for name, shape in MODELS.items():
        path = str(ensure_tiny_model(args.model_dir, name=name, **shape))
        best: dict[str, dict[int, tuple[float, float]]] = {side: {} for side in trees}
        for _ in range(args.rounds):
            for side, tree in trees.items():
                for batch, timing in run_worker(tree, path, args.windows, args.threads).items():
                    if batch not in best[side] or timing[0] < best[side][batch][0]:
                        best[side][batch] = timing
        for batch in BATCHES:
            row = {"model": name, "batch": batch}
            for side in trees:
                step, forward = best[side][batch]
                row[side] = {
                    "step_ms": 1e3 * step, "forward_ms": 1e3 * forward, "overhead_ms": 1e3 * (step - forward)
                }
            rows.append(row)
    result = {"threads": args.threads, "trees": {k: str(v) for k, v in trees.items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))


def render(result: dict) -> str:
    sides = list(result["trees"])
    compared = len(sides) == 2
    head = "| model | batch | " + " | ".join(f"{s}: step / forward / overhead ms" for s in sides)
    lines = [head + (" | speedup |" if compared else " |"), "|---|---:|" + "---:|" * (len(sides) + compared)]
    for row in result["rows"]:
        keys = ("step_ms", "forward_ms", "overhead_ms")
        cells = [" / ".join(f"{row[s][key]:.2f}" for key in keys) for s in sides]
        if compared:
            cells.append(f"{row['compare']['step_ms'] / row['this']['step_ms']:.2f}x")
        lines.append(f"| {row['model']} | {row['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker_main(*sys.argv[2:])
    else:
        main()
