"""Write a JSONL dataset for ``xinserve bench --dataset`` with three categories of chat prompts:
``short`` (a dozen words), ``long`` (about ``--long-tokens`` tokens of the given tokenizer; 1,800 by
default, so that it fits the 2,048-token context of the embedded tiny model with its output) and
``multi-turn`` (three user turns with two assistant answers between them).

    python benchmarks/make_dataset.py --out mixed.jsonl [--tokenizer MODEL_DIR]
"""

import argparse
import json
import random
from pathlib import Path
from typing import Any

from xinserve.server.cli.bench.dataset import random_words


def long_prompt(tokenizer: Any, rng: random.Random, tokens: int) -> str:
    """Random words cut to ``tokens`` tokens of ``tokenizer`` (re-encoding may differ by a few)."""
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tokenizer.encode(" " + random_words(rng, tokens), add_special_tokens=False, verbose=False)
    return tokenizer.decode(ids[:tokens]).strip()


def rows(tokenizer: Any, per_category: int, long_tokens: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(per_category):
        out.append({"category": "short", "messages": [{"role": "user", "content": random_words(rng, 12)}]})
        out.append({"category": "long", "messages": [
            {"role": "user", "content": long_prompt(tokenizer, rng, long_tokens)}]})
        turns = []
        for turn in range(3):
            turns.append({"role": "user", "content": random_words(rng, 16)})
            if turn < 2:
                turns.append({"role": "assistant", "content": random_words(rng, 24)})
        out.append({"category": "multi-turn", "messages": turns})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", help="a tokenizer directory (default: the embedded tiny model's)")
    p.add_argument("--per-category", type=int, default=8)
    p.add_argument("--long-tokens", type=int, default=1800)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from xinserve.server.embedded_model.tokenizer import build_tokenizer

        tokenizer = build_tokenizer()
    data = rows(tokenizer, args.per_category, args.long_tokens, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in data))
    print(f"wrote {len(data)} prompts to {out}")


if __name__ == "__main__":
    main()
