"""What multi-LoRA costs a decode step on the CPU: the forward's mean time per decode step of the random 5M
Llama at batch 1 / 8 / 32, without LoRA, with LoRA enabled but every row on the base model, and with every
row on one of ``max_loras`` rank-16 adapters (all seven projections targeted), with the ops the kernel
registry chose (the pure-torch reference until a faster kernel is registered: a few rank-R matmuls per slot
and projection). Prints a markdown table and writes ``benchmarks/results/lora_overhead.json``.

    python benchmarks/lora_overhead.py            # 64 timed decode steps per row
    python benchmarks/lora_overhead.py --quick    # 16
"""

import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("XINSERVE_COMPILE", "off")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from common import decode_engine, forward_clock, llama_5m, markdown_table, script_args, write_result

from tests.engines.lora.conftest import make_adapter
from xinserve.engines import SamplingParams

BATCHES = (1, 8, 32)
RANK, MAX_LORAS, CONTEXT = 16, 4, 64


def decode_ms(llm, batch: int, steps: int, adapters: list[str | None]) -> float:
    """Mean forward milliseconds of ``steps`` decode steps of ``batch`` sequences, row i on adapters[i % n]."""
    engine = llm.engine
    for i in range(batch):
        params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True,
                                lora_name=adapters[i % len(adapters)])
        engine.add_request(f"{batch}-{i}", [7 + (i * 31 + j * 7) % 900 for j in range(CONTEXT)], params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    for _ in range(4):
        engine.step()
    with forward_clock(engine.runner) as clock:
        for _ in range(steps):
            engine.step()
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return 1e3 * clock.seconds / steps


def main() -> None:
    parser = script_args(__doc__, "lora_overhead.json", quick_help="16 timed steps per row")
    args = parser.parse_args()
    steps = 16 if args.quick else 64
    model = llama_5m(args.model_dir)
    adapter_dir = Path(tempfile.mkdtemp())
    names = [f"a{i}" for i in range(MAX_LORAS)]
    modules = {name: str(make_adapter(Path(model), adapter_dir / name, RANK, seed=i)) for i, name in enumerate(names)}
    setups = {"off": ({}, [None]), "on, base rows": ({"enable_lora": True}, [None]),
              f"on, {MAX_LORAS} adapters": ({"enable_lora": True}, names)}
    rows, result = [], {"machine": platform.processor() or platform.machine(), "rank": RANK, "max_loras": MAX_LORAS,
                        "steps": steps, "rows": []}
    for label, (options, adapters) in setups.items():
        lora = {"max_loras": MAX_LORAS, "max_lora_rank": RANK, "lora_modules": modules} if options else {}
        with decode_engine(model, max(BATCHES), CONTEXT, steps, **options, **lora) as llm:
            for batch in BATCHES:
                start = time.perf_counter()
                ms = decode_ms(llm, batch, steps, adapters)
                result["rows"].append({"lora": label, "batch": batch, "forward_ms": round(ms, 3),
                                       "wall_s": round(time.perf_counter() - start, 2)})
    base = {r["batch"]: r["forward_ms"] for r in result["rows"] if r["lora"] == "off"}
    for r in result["rows"]:
        rows.append([r["lora"], r["batch"], f"{r['forward_ms']:.2f}", f"{r['forward_ms'] / base[r['batch']]:.2f}x"])
    print(markdown_table(["LoRA", "batch", "forward ms / decode step", "x off"], rows))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
