"""Speculative decoding on CPU: output tokens/s and TPOT at concurrency 1 / 8 / 32, with and without
drafts; the acceptance rate; the mean step time (what verifying 1 + k rows per sequence costs against
one); and what method ``mtp`` costs per step.

- n-gram (prompt lookup) on stories260K (tests/fixtures, a trained model) with a repetitive workload:
  each prompt is a random phrase repeated, decoded greedily with ``ignore_eos``; the trained model
  goes on repeating, which prompt lookup drafts. Drafting is on at every concurrency here
  (``disable_by_batch_size`` past the largest), so the table shows where it stops paying; the
  engine's default threshold (engines/speculative/config.py) comes from it. ``--random-llama``: the
  old workload, a random ~5M-parameter Llama.
- MTP's cost per step: a tiny DeepSeek-V3 whose MTP layer is random (a trained MTP head is not
  available offline, so its acceptance here says nothing), decode steps with k MTP drafts against
  plain decode steps: the step time, which includes the MTP layer's catch-up and its k - 1 chained
  decode forwards besides the 1 + k-row verification.
Each row with speculation has ``step x plain``: its mean step time over the plain row's at the same
concurrency (wall and CPU time: the CPU time of this process, the engine's, is what a loaded machine
distorts least). Prints markdown tables and writes ``benchmarks/results/speculative.json``.

    python benchmarks/speculative.py           # stories260K n-gram, then MTP's cost, at c = 1 / 8 / 32
    python benchmarks/speculative.py --quick   # the committed result: 24-token outputs, one repeat

Smoke run: ``python benchmarks/speculative.py --quick --concurrency 1 --out /tmp/spec.json``.
"""

import argparse
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("XINSERVE_COMPILE", "off")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

import torch
from common import RESULTS, write_result
from transformers.utils import logging as hf_logging

from xinserve.engines import LLM, SamplingParams
from xinserve.server.embedded_model.factory import make_tiny_model

STORIES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "stories260K"
FIRST_ID = 7  # past the tiny tokenizer's special tokens
MEDIUM = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 768}


@dataclass
class Row:
    concurrency: int
    speculative: str  # "off", "ngram k=K" or "mtp k=K"
    output_tok_s: float
    tpot_ms: float  # mean over requests: (last token - first token) / (tokens - 1)
    step_ms: float  # mean wall time of one engine step
    cpu_step_ms: float  # mean CPU time (this process) of one engine step
    steps: int
    acceptance_rate: float | None
    tokens_per_draft_step: float | None  # accepted drafts + 1 per verified sequence-step
    step_x_plain: float | None = None  # step_ms over the plain row's at this concurrency
    cpu_step_x_plain: float | None = None  # the same in CPU time


# stories260K writes children's stories: a story's sentence repeated makes it go on repeating itself
STORY_LINES = [
    "Once upon a time, there was a little girl named Lily. She loved to play in the park.",
    "Tom had a big red ball. He liked to throw the ball to his dog, Max.",
    "The sun was shining and the birds were singing. Sue went outside to play with her friends.",
    "One day, a little cat found a box. The cat was very happy and jumped into the box.",
]


def prompts_for(count: int, vocab: int, seed: int, phrase: int = 8, repeats: int = 8,
                tokenizer: object | None = None) -> list[list[int]]:
    """Each prompt a phrase repeated: a random one, or (``tokenizer``: stories260K) a story line, 3 times."""
    rng = random.Random(seed)
    if tokenizer is not None:
        lines = [tokenizer.encode(" ".join([STORY_LINES[(seed + i) % len(STORY_LINES)]] * 3)) for i in range(count)]
        return [line[: 8 * phrase] for line in lines]
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(phrase)] * repeats for _ in range(count)]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, float, float, int]:
    """(wall seconds, mean TPOT seconds, mean step seconds, mean step CPU seconds, steps) of the requests
    run together."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", prompt, params)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    steps = 0
    start, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        outputs = engine.step().outputs
        steps += 1
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tpot = sum((last[r] - first[r]) / (max_tokens - 1) for r in first) / len(first)
    return wall, tpot, wall / steps, cpu / steps, steps


def measure(llm: LLM, label: str, concurrency: int, vocab: int, max_tokens: int, repeats: int,
            stories: bool = False) -> Row:
    prompts = prompts_for(concurrency, vocab, seed=concurrency, tokenizer=llm.tokenizer if stories else None)
    run(llm, prompts[:1], 4)  # warm-up
    before = llm.engine.stats().spec_decode
    best = None
    for _ in range(repeats):
        result = run(llm, prompts, max_tokens)
        best = result if best is None or result[0] < best[0] else best
    after = llm.engine.stats().spec_decode
    rate = per_step = None
    if after is not None and after.num_drafts > before.num_drafts:
        drafts = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        rate = accepted / drafts if drafts else None
        per_step = 1 + accepted / (after.num_drafts - before.num_drafts)
    wall, tpot, step, cpu_step, steps = best
    return Row(concurrency, label, concurrency * max_tokens / wall, tpot * 1e3, step * 1e3, cpu_step * 1e3, steps,
               rate, per_step)


def table(rows: list[Row], model: str) -> None:
    print(f"\n{model}\n")
    print("| concurrency | speculation | out tok/s | TPOT ms | step ms | CPU ms/step | step x plain (CPU) | steps "
          "| acceptance | tokens/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r.concurrency, r.speculative)):
        rate = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f}"
        per = "-" if r.tokens_per_draft_step is None else f"{r.tokens_per_draft_step:.2f}"
        ratio = "-" if r.step_x_plain is None else f"{r.step_x_plain:.2f} ({r.cpu_step_x_plain:.2f})"
        print(f"| {r.concurrency} | {r.speculative} | {r.output_tok_s:.0f} | {r.tpot_ms:.2f} | {r.step_ms:.2f} "
              f"| {r.cpu_step_ms:.2f} | {ratio} | {r.steps} | {rate} | {per} |")


def compare(path: Path, spec: dict, label: str, concurrency: list[int], max_tokens: int, repeats: int) -> list[Row]:
    """Rows without and with ``spec`` at each concurrency."""
    common = {"num_kv_blocks": 4096, "block_size": 16, "max_num_seqs": max(concurrency)}
    rows = []
    for name, options in (("off", {}), (label, {"speculative_config": spec})):
        llm = LLM(path, **common, **options)
        vocab = llm.engine.vocab_size
        rows += [measure(llm, name, c, vocab, max_tokens, repeats, path == STORIES) for c in concurrency]
        llm.close()
    plain = {r.concurrency: r for r in rows if r.speculative == "off"}
    for r in rows:
        if r.speculative != "off":
            r.step_x_plain = r.step_ms / plain[r.concurrency].step_ms
            r.cpu_step_x_plain = r.cpu_step_ms / plain[r.concurrency].cpu_step_ms
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="24-token outputs, one repeat (under 2 minutes)")
    parser.add_argument("--random-llama", action="store_true", help="n-gram on a random ~5M Llama, not stories260K")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--repeats", type=int, default=None, help="runs per row, the fastest kept (default 2; quick 1)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    max_tokens = 24 if args.quick else 96
    repeats = args.repeats or (1 if args.quick else 2)
    ngram_model = STORIES
    if args.random_llama:
        ngram_model = make_tiny_model(tempfile.mkdtemp(prefix="xinserve-spec-"), "llama", **MEDIUM)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
             "disable_by_batch_size": max(args.concurrency)}
    ngram_rows = compare(ngram_model, ngram, f"ngram k={args.k}", args.concurrency, max_tokens, repeats)
    table(ngram_rows, "n-gram: random Llama" if args.random_llama else "n-gram: stories260K")
    mtp_model = make_tiny_model(tempfile.mkdtemp(prefix="xinserve-mtp-"), "deepseek_v3", mtp=True)
    mtp = {"method": "mtp", "num_speculative_tokens": args.k, "disable_by_batch_size": max(args.concurrency)}
    mtp_rows = compare(mtp_model, mtp, f"mtp k={args.k}", args.concurrency, max_tokens, repeats)
    table(mtp_rows, "MTP's cost per step: tiny DeepSeek-V3, random MTP layer")
    write_result(args.out, {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "load_average": os.getloadavg()},
        "ngram_model": "random llama" if args.random_llama else "stories260K", "max_tokens": max_tokens, "k": args.k,
        "quick": args.quick, "repeats": repeats,
        "rows": [asdict(r) for r in ngram_rows],
        "mtp_model": "tiny deepseek_v3, random MTP layer", "mtp_rows": [asdict(r) for r in mtp_rows],
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
