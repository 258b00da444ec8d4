"""Decode step time of a ~50M-parameter mixture-of-experts model (Qwen3-MoE layout, 8 experts, top-2,
every layer sparse): the engine against transformers' own forward, at batch 1, 8 and 32.

Engine: ``engine.step()`` in steady decode after 128-token prompts (greedy, ignore_eos), once with
the reference fused_moe (the CPU default: per-expert matmuls after sorting the tokens by expert) and
once with ``torch._grouped_mm`` forced; the model forward (decoder + logits) inside the step is
timed by wrapping the runner's ``forward`` (benchmarks/engine_timing.py). transformers: ``model(next_tokens, past_key_values=cache)`` on a batch that has prefilled the
same prompts (its default experts implementation, recorded in the output). Each figure is the best
of several windows of 10 steps (on a shared machine the minimum is the least disturbed estimate).
One thread, float32. Prints a markdown table and writes ``benchmarks/results/moe_decode.json``.

    python benchmarks/moe_decode.py [--windows 6]
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from engine_timing import forward_clock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "moe_decode.json"
# 8 layers of hidden 384 with 8 experts of intermediate 512: 38M expert and 48M total parameters
MODEL = {"arch": "qwen3_moe", "hidden_size": 384, "num_layers": 8, "num_heads": 6, "num_kv_heads": 2,
         "vocab_size": 8000, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512,
         "mlp_only_layers": []}
BATCHES = (1, 8, 32)
PROMPT_LEN, WARM_STEPS, WINDOW = 128, 3, 10


def prompts(batch: int) -> list[list[int]]:
    return [[7 + (i * 31 + j * 7) % 7900 for j in range(PROMPT_LEN)] for i in range(batch)]


def engine_steps(path: str, windows: int, fused_moe: str) -> dict[int, dict[str, float]]:
    """batch -> best window's step and forward milliseconds of the engine."""
    from xinserve.engines import LLM, SamplingParams

    num_blocks = max(BATCHES) * (PROMPT_LEN + WARM_STEPS + windows * WINDOW + 16) // 16 + 8
    llm = LLM(path, num_kv_blocks=num_blocks, max_num_seqs=max(BATCHES), block_size=16,
              max_num_batched_tokens=max(BATCHES) * PROMPT_LEN, kernels={"fused_moe": fused_moe})
    engine, runner = llm.engine, llm.engine.runner
    assert runner.kernels.chosen["fused_moe"] == fused_moe
    params = SamplingParams(temperature=0, max_tokens=WARM_STEPS + windows * WINDOW + 8, ignore_eos=True)
    best: dict[int, dict[str, float]] = {}
    for batch in BATCHES:
        for i, prompt in enumerate(prompts(batch)):
            engine.add_request(f"{batch}-{i}", prompt, params)
        for _ in range(WARM_STEPS):  # the prefill, then a few decodes
            engine.step()
        for _ in range(windows):
            with forward_clock(runner) as forward:
                start = time.perf_counter()
                for _ in range(WINDOW):
                    engine.step()
                step = (time.perf_counter() - start) / WINDOW
            if batch not in best or step < best[batch]["step_ms"] / 1e3:
                best[batch] = {"step_ms": 1e3 * step, "forward_ms": 1e3 * forward.seconds / WINDOW}
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
    return best


def transformers_steps(path: str, windows: int) -> tuple[dict[int, float], str, int]:
    """batch -> best window's milliseconds of one decode forward; the experts implementation; the
    model's parameter count."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    implementation = str(getattr(model.config, "_experts_implementation_internal", None)
                         or getattr(model.config, "_experts_implementation", None))
    best = {}
    with torch.inference_mode():
        for batch in BATCHES:
            cache = DynamicCache(config=model.config)
            out = model(torch.tensor(prompts(batch)), cache=cache, use_cache=True)
            tokens = out.logits[:, -1:].argmax(-1)
            for step in range(WARM_STEPS + windows * WINDOW):
                if step >= WARM_STEPS and (step - WARM_STEPS) % WINDOW == 0:
                    start = time.perf_counter()
                out = model(tokens, cache=cache, use_cache=True)
                tokens = out.logits[:, -1:].argmax(-1)
                if step >= WARM_STEPS and (step - WARM_STEPS) % WINDOW == WINDOW - 1:
                    best[batch] = min(best.get(batch, float("inf")), 1e3 * (time.perf_counter() - start) / WINDOW)
    return best, implementation, sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=6, help=f"timed windows of {WINDOW} steps per batch")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from xinserve.server.embedded_model.factory import ensure_tiny_model

    path = str(ensure_tiny_model(args.model_dir, name="qwen3-moe-48m", **MODEL))
    ours = {impl: engine_steps(path, args.windows, impl) for impl in ("reference", "grouped_mm")}
    hf, implementation, num_parameters = transformers_steps(path, args.windows)
    rows = [{"batch": batch, "engine_reference": ours["reference"][batch],
             "engine_grouped_mm": ours["grouped_mm"][batch], "transformers_ms": hf[batch]} for batch in BATCHES]
    result = {"model": MODEL, "parameters": num_parameters, "threads": 1, "dtype": "float32", "transformers_experts": implementation,
              "torch": torch.__version__, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))


def render(result: dict) -> str:
    title = f"{result['parameters'] / 1e6:.0f}M parameters; transformers experts: {result['transformers_experts']}"
    head = ("| batch | engine step ms (reference fused_moe) | forward ms | engine step ms (grouped_mm) | forward ms "
            "| transformers forward ms | speedup (best engine step) |")
    lines = [title, head, "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        ref, grouped = row["engine_reference"], row["engine_grouped_mm"]
        fastest = min(ref["step_ms"], grouped["step_ms"])
        lines.append(f"| {row['batch']} | {ref['step_ms']:.2f} | {ref['forward_ms']:.2f} | {grouped['step_ms']:.2f} | "
                     f"{grouped['forward_ms']:.2f} | {row['transformers_ms']:.2f} | "
                     f"{row['transformers_ms'] / fastest:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
