"""xgrammar against llguidance for JSON-schema constrained decoding: the numbers behind our choice.

For each vocabulary (the embedded model's 1,000-token BPE, and a 32,000-token byte-level BPE trained
here on the Python standard library's sources, as big as Llama 2's) it measures

- ``tokenizer_ms``: the one-off preprocessing of a vocabulary (per model, at worker start);
- ``compile_ms``: a cold compile of a typical extraction schema (nested objects, an array of
  objects, enums, ``maxLength``, optional fields) and of "any JSON object", median of a few runs;
- ``mask_ms``: at batch 32, the per-step cost on the engine's path: fill the 32 token bitmasks,
  apply them to [32, V] float32 logits, and advance each matcher by its token. The 32 matchers walk
  32 different valid documents, so they sit in different grammar states, as real sequences do.
  Measured with one thread (what a worker next to the HTTP process gets on 2 cores) and with the
  library's parallel batch fill.

Prints a markdown table and writes ``benchmarks/results/grammar_backends.json``.

    python benchmarks/grammar_backends.py            # the committed result: a few minutes (the 32k tokenizer is trained once)
    python benchmarks/grammar_backends.py --quick    # smoke run: the 1k vocabulary only (add --out /tmp/g.json)

llguidance comes with the ``bench`` extra (``pip install 'xinserve[bench]'``); the server uses xgrammar alone.
"""

import argparse
import json
import os
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar
from common import RESULTS, write_result
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from xinserve.server.embedded_model.tokenizer import build_tokenizer

BATCH = 32
COMPILE_RUNS = 5

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
        "genre": {"enum": ["novel", "poetry", "history", "science", "travel"]},
        "rating": {"type": "number"},
        "available": {"type": "boolean"},
        "authors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 40}, "born": {"type": "integer"}},
                "required": ["name"],
            },
            "minItems": 1,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
        "publisher": {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
                      "required": ["name", "city"]},
    },
    "required": ["title", "year", "genre", "authors", "available"],
}
WORDS = ["river", "library", "bread", "harbour", "sailor", "garden", "violin", "atlas", "mountain", "letter", "coast", "market"]


def documents(count: int, seed: int) -> list[str]:
    """``count`` different JSON texts valid under ``SCHEMA``."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        doc = {
            "title": " ".join(rng.sample(WORDS, rng.randint(1, 4))).title(),
            "year": rng.randint(1800, 2100),
            "genre": rng.choice(SCHEMA["properties"]["genre"]["enum"]),
            "rating": round(rng.uniform(0, 5), rng.randint(0, 3)),
            "available": rng.random() < 0.5,
            "authors": [{"name": f"{rng.choice(WORDS).title()} {rng.choice(WORDS).title()}",
                         "born": rng.randint(1700, 2000)} for _ in range(rng.randint(1, 3))],
            "tags": rng.sample(WORDS, rng.randint(0, 3)),
            "publisher": {"name": rng.choice(WORDS).title() + " Press", "city": rng.choice(WORDS).title()},
        }
        docs.append(json.dumps(doc))
    return docs


def stdlib_tokenizer(vocab_size: int, cache: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens trained on the standard library's sources (cached)."""
    path = cache / f"stdlib-bpe-{vocab_size}.json"
    if not path.exists():
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        texts = (f.read_text(encoding="utf-8", errors="replace") for f in files)  # a few are Latin-1
        tokenizer.train_from_iterator(texts, trainer=trainer)
        cache.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<s>", eos_token="</s>")


def _median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos: int) -> None:
        start = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        self.tokenizer_ms = 1e3 * (time.perf_counter() - start)
        self.vocab_size = vocab_size
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: dict | None):
        compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if schema is None:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_json_schema(json.dumps(schema))

    def matchers(self, compiled, count: int) -> list:
        return [xgrammar.GrammarMatcher(compiled) for _ in range(count)]

    def bitmask(self, rows: int) -> torch.Tensor:
        return xgrammar.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers: list, bitmask: torch.Tensor, parallel: bool) -> None:
        if parallel:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos: int) -> None:
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.tokenizer_ms = 1e3 * (time.perf_counter() - start)
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema: dict | None):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema if schema is not None else {"type": "object"}))
        # llguidance has no separate compile step: building a matcher is the compile (lazy lexer).
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matchers(self, compiled, count: int) -> list:
        return [llguidance.LLMatcher(self.tokenizer, compiled) for _ in range(count)]

    def bitmask(self, rows: int) -> torch.Tensor:
        return llguidance.torch.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers: list, bitmask: torch.Tensor, parallel: bool) -> None:
        if parallel:
            llguidance.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)],
                                                         bitmask)
        else:
            for i, m in enumerate(matchers):
                llguidance.torch.fill_next_token_bitmask(m, bitmask, i)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


def walk(backend, compiled, token_lists: list[list[int]], parallel: bool) -> dict[str, float]:
    """Decode the 32 documents in lockstep under the grammar; mean ms per step of each part."""
    matchers = backend.matchers(compiled, len(token_lists))
    bitmask = backend.bitmask(len(token_lists))
    logits = torch.randn(len(token_lists), backend.vocab_size)
    steps = min(len(t) for t in token_lists)
    fill = apply = accept = 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        backend.fill(matchers, bitmask, parallel)
        t1 = time.perf_counter()
        backend.apply(logits, bitmask)
        t2 = time.perf_counter()
        for m, tokens in zip(matchers, token_lists):
            if not backend.accept(m, tokens[step]):
                raise RuntimeError(f"{backend.name} refused a valid token at step {step}")
        t3 = time.perf_counter()
        fill, apply, accept = fill + t1 - t0, apply + t2 - t1, accept + t3 - t2
    return {"fill_ms": 1e3 * fill / steps, "apply_ms": 1e3 * apply / steps, "accept_ms": 1e3 * accept / steps,
            "mask_ms": 1e3 * (fill + apply + accept) / steps, "steps": steps}


def measure(backend_cls, tokenizer, label: str) -> dict:
    vocab_size, eos = len(tokenizer), tokenizer.eos_token_id
    backend = backend_cls(tokenizer, vocab_size, eos)
    row = {"backend": backend.name, "vocab": label, "vocab_size": vocab_size,
           "tokenizer_ms": backend.tokenizer_ms,
           "compile_ms": _median_ms(lambda: backend.compile(SCHEMA), COMPILE_RUNS),
           "compile_json_object_ms": _median_ms(lambda: backend.compile(None), COMPILE_RUNS)}
    token_lists = [tokenizer.encode(d, add_special_tokens=False) for d in documents(BATCH, seed=1)]
    compiled = backend.compile(SCHEMA)
    torch.set_num_threads(1)
    walk(backend, compiled, token_lists, parallel=False)  # warm-up
    row["one_thread"] = walk(backend, compiled, token_lists, parallel=False)
    row["parallel"] = walk(backend, compiled, token_lists, parallel=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the 1k vocabulary only")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "xinserve-bench",
                        help="where the 32k tokenizer is trained once and reused")
    parser.add_argument("--out", type=Path, default=RESULTS / "grammar_backends.json")
    args = parser.parse_args()
    vocabularies = [("tiny-1k", build_tokenizer())]
    if not args.quick:
        vocabularies.append(("stdlib-bpe-32k", stdlib_tokenizer(32000, args.cache)))
    rows = [measure(cls, tok, label) for label, tok in vocabularies for cls in (XGrammar, LLGuidance)]
    print("| backend | vocab | tokenizer ms | compile ms | json_object ms | batch-32 step ms (1 thread) "
          "| fill / apply / accept | batch-32 step ms (parallel fill) |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        one, par = r["one_thread"], r["parallel"]
        print(f"| {r['backend']} | {r['vocab']} | {r['tokenizer_ms']:.1f} | {r['compile_ms']:.2f} "
              f"| {r['compile_json_object_ms']:.2f} | {one['mask_ms']:.3f} "
              f"| {one['fill_ms']:.3f} / {one['apply_ms']:.3f} / {one['accept_ms']:.3f} | {par['mask_ms']:.3f} |")
    result = {"batch": BATCH, "schema": SCHEMA, "torch": torch.__version__,
              "xgrammar": xgrammar.__version__ if hasattr(xgrammar, "__version__") else None,
              "llguidance": llguidance.get_version() if hasattr(llguidance, "get_version") else None,
              "rows": rows}
    write_result(args.out, result)


if __name__ == "__main__":
    main()
