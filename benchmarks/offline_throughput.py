"""Offline throughput: xinserve's engine against transformers' ``generate`` on the same model.

The engine (continuous batching over a paged KV cache) and Hugging Face ``generate`` (static
batches, left padding, a batch runs until its longest request is done) both decode greedily with
``ignore_eos`` on one locally built, randomly initialised Llama:

- equal lengths: batch 1, 8 and 32, 128-token prompts, 128 new tokens each;
- mixed lengths: 32 requests whose max_tokens are drawn from 16-256 (fixed seed), at batch 8
  and 32. Only the requested tokens count, so a static batch pays for its padding steps.

Output tokens/s is the best of ``--repeats`` runs. For the engine it also reports one step's wall
time, the model forward inside it (decoder plus logits, the runner's ``forward`` timed from outside
by ``common.forward_clock``) and the difference: the per-step overhead of scheduling, input preparation
and sampling. Prints a markdown table and writes ``benchmarks/results/offline_throughput.json``. The
committed result (the ~30M-parameter model, a few minutes; ``make bench`` runs the same):

    python benchmarks/offline_throughput.py

Smoke run (a tiny model, batch 1 and 8): ``python benchmarks/offline_throughput.py --quick --out /tmp/o.json``.
"""

import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

import torch
from common import StepClock, forward_clock, script_args, write_result
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from xinserve.engines import LLM, SamplingParams
from xinserve.server.embedded_model.factory import ensure_tiny_model

FIRST_ID = 7  # past the tiny tokenizer's special tokens


@dataclass(frozen=True)
class Setup:
    name: str
    model: dict  # make_tiny_model keyword arguments
    prompt_len: int
    max_tokens: int  # equal-length workload
    batches: tuple[int, ...]
    mixed_requests: int
    mixed_range: tuple[int, int]  # max_tokens drawn uniformly from this closed range
    mixed_batches: tuple[int, ...]


FULL = Setup(
    name="llama-30m",
    model={"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
           "intermediate_size": 1536, "vocab_size": 8000},
    prompt_len=128, max_tokens=128, batches=(1, 8, 32),
    mixed_requests=32, mixed_range=(16, 256), mixed_batches=(8, 32),
)
QUICK = Setup(
    name="llama-quick",
    model={"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    prompt_len=16, max_tokens=8, batches=(1, 8),
    mixed_requests=8, mixed_range=(2, 16), mixed_batches=(8,),
)


@dataclass
class Row:
    workload: str  # "equal" | "mixed"
    batch: int
    requests: int
    output_tokens: int  # tokens the requests asked for
    engine_tok_s: float
    hf_tok_s: float
    speedup: float = field(init=False)
    engine_step_ms: float = 0.0  # mean wall time of one engine step
    engine_forward_ms: float = 0.0  # of which the model forward and logits
    engine_overhead_ms: float = 0.0  # the rest: scheduling, inputs, sampling, bookkeeping
    engine_steps: int = 0

    def __post_init__(self) -> None:
        self.speedup = self.engine_tok_s / self.hf_tok_s


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(length)] for _ in range(count)]


def run_engine(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, dict]:
    """Wall seconds of one ``generate`` and the engine's step timings summed over it."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    # The steps' own wall time, without LLM.generate's detokenising around them.
    engine = llm.engine
    llm.engine = steps = StepClock(engine)
    try:
        with forward_clock(engine.runner) as forward:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            wall = time.perf_counter() - start
    finally:
        llm.engine = engine
    timing = {"steps": steps.steps, "step_s": steps.seconds, "forward_s": forward.seconds}
    if [len(o.token_ids) for o in outputs] != max_tokens:
        raise RuntimeError("the engine did not generate the requested number of tokens")
    return wall, timing


def run_hf(model, prompts: list[list[int]], max_tokens: list[int], batch: int) -> float:
    """Wall seconds of static batches in request order, each left-padded and run to its longest."""
    pad_id = model.config.pad_token_id
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(max_tokens[i : i + batch]),
                           do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - start


def measure(llm: LLM, hf, workload: str, batch: int, prompts, max_tokens: list[int], repeats: int) -> Row:
    """Best of ``repeats`` for both sides, alternating so that both see the same machine load."""
    best_engine, best_timing, best_hf = float("inf"), {}, float("inf")
    for _ in range(repeats):
        wall, timing = run_engine(llm, prompts, max_tokens)
        if wall < best_engine:
            best_engine, best_timing = wall, timing
        best_hf = min(best_hf, run_hf(hf, prompts, max_tokens, batch))
    tokens, steps = sum(max_tokens), best_timing["steps"]
    return Row(
        workload, batch, len(prompts), tokens, tokens / best_engine, tokens / best_hf,
        engine_step_ms=1e3 * best_timing["step_s"] / steps,
        engine_forward_ms=1e3 * best_timing["forward_s"] / steps,
        engine_overhead_ms=1e3 * (best_timing["step_s"] - best_timing["forward_s"]) / steps,
        engine_steps=steps,
    )


def make_engine(path: Path, dtype: str, batch: int, max_model_len: int) -> LLM:
    """An engine that runs at most ``batch`` requests at once, with blocks for all of them."""
    block_size = 16
    num_blocks = batch * -(-max_model_len // block_size) + 8
    llm = LLM(str(path), dtype=dtype, max_num_seqs=batch, max_model_len=max_model_len,
              block_size=block_size, num_kv_blocks=num_blocks)
    run_engine(llm, [[FIRST_ID] * 8], [2])  # warm-up
    return llm


def cpu_info() -> dict:
    flags: set[str] = set()
    name = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
    return {
        "name": name,
        "cores": os.cpu_count(),
        "amx_bf16": "amx_bf16" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
    }


def main() -> None:
    parser = script_args(__doc__, "offline_throughput.json", "smoke run: tiny model, batch 1 and 8")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="auto: bfloat16 when the CPU has AMX, else float32")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both sides (default: usable cores but one, at least 1)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per point, best kept (3; quick 1)")
    args = parser.parse_args()
    setup = QUICK if args.quick else FULL
    repeats = args.repeats or (1 if args.quick else 3)
    cpu = cpu_info()
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if cpu["amx_bf16"] else "float32")
    # The server's policy for a CPU worker: one core stays free for the HTTP process. On a shared
    # 2-core machine two threads were up to 10x slower whenever anything else ran.
    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) - 1))
    hf_logging.set_verbosity_error()

    path = ensure_tiny_model(args.model_dir, name=setup.name, **setup.model)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos: every request runs to its max_tokens
    run_hf(hf, [[FIRST_ID] * 8], [2], 1)  # warm-up
    vocab = min(hf.config.vocab_size, 1000)  # ids the tiny tokenizer can produce
    max_model_len = setup.prompt_len + max(setup.max_tokens, setup.mixed_range[1])

    rows = []
    for batch in setup.batches:
        prompts = make_prompts(batch, setup.prompt_len, vocab, seed=batch)
        llm = make_engine(path, dtype, batch, max_model_len)
        rows.append(measure(llm, hf, "equal", batch, prompts, [setup.max_tokens] * batch, repeats))
    rng = random.Random(1234)
    mixed_tokens = [rng.randint(*setup.mixed_range) for _ in range(setup.mixed_requests)]
    mixed_prompts = make_prompts(setup.mixed_requests, setup.prompt_len, vocab, seed=99)
    for batch in setup.mixed_batches:
        llm = make_engine(path, dtype, batch, max_model_len)
        rows.append(measure(llm, hf, "mixed", batch, mixed_prompts, mixed_tokens, repeats))

    result = {
        "model": {"name": setup.name, "parameters": sum(p.numel() for p in hf.parameters()), **setup.model},
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "cpu": cpu,
        "torch": torch.__version__,
        "workload": {
            "prompt_len": setup.prompt_len, "max_tokens": setup.max_tokens,
            "mixed_requests": setup.mixed_requests, "mixed_range": list(setup.mixed_range),
            "greedy": True, "ignore_eos": True, "repeats": repeats,
        },
        "rows": [asdict(r) for r in rows],
    }
    write_result(args.out, result)
    print(render(result))
    print(f"\nwrote {args.out}")


def render(result: dict) -> str:
    m, cpu = result["model"], result["cpu"]
    amx = "yes" if cpu["amx_bf16"] else "no"
    lines = [
        f"Model {m['name']}: {m['parameters'] / 1e6:.1f}M parameters, {result['dtype']}, "
        + f"{result['threads']} thread(s) on {cpu['name']} (AMX: {amx})",
        "",
        "| workload | batch | requests | engine tok/s | HF generate tok/s | speedup | engine step ms "
        + "| forward ms | overhead ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['workload']} | {r['batch']} | {r['requests']} | {r['engine_tok_s']:.0f} "
            f"| {r['hf_tok_s']:.0f} "
            f"| {r['speedup']:.2f}x | {r['engine_step_ms']:.2f} | {r['engine_forward_ms']:.2f} "
            f"| {r['engine_overhead_ms']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
