"""The worker's grammar compiler: JSON schema -> xgrammar ``CompiledGrammar``, in a thread, cached.

The schema's text crosses from the HTTP process, not a compiled grammar: the compiled form depends
on this worker's vocabulary (the model's, padded beyond the tokenizer's) and stop tokens, the
offline ``LLM`` has no HTTP process to compile in, and a compiled grammar's size grows with the
vocabulary while the schema stays small. One background thread compiles; a request waits, outside
the scheduler, until its grammar is ready, so the step loop never runs a compile itself.
"""

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xgrammar

from engines.structured.schema import GRAMMAR_OPTIONS


@dataclass(slots=True)
class OutputGrammar:
    """One sequence's grammar state: its matcher, advanced by each token the sequence accepts and
    asked for the next token mask, and the worker's filter of JSON-safe tokens."""

    matcher: xgrammar.GrammarMatcher
    json_tokens: torch.Tensor  # [ceil(V / 32)] int32 bitmask, shared by the worker's grammars


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int = 128) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler: xgrammar.GrammarCompiler | None = None  # built in the thread on first use
        self._json_tokens: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._cache_size = cache_size

    def compile(self, schema: str) -> Future:
        """A future of the compiled grammar for ``schema`` (JSON text); the same one while cached."""
        future = self._cache.get(schema)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(schema)
            return future
        future = self._pool.submit(self._compile, schema)
        self._cache[schema] = future
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return future

    def new_grammar(self, compiled: xgrammar.CompiledGrammar) -> OutputGrammar:
        """A fresh state for one sequence (each choice of an n > 1 request has its own)."""
        assert self._json_tokens is not None  # set by the compile that produced ``compiled``
        return OutputGrammar(xgrammar.GrammarMatcher(compiled), self._json_tokens)

    def _compile(self, schema: str) -> xgrammar.CompiledGrammar:
        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
            )
            self._json_tokens = _json_tokens(info.decoded_vocab, self._vocab_size)
            # One thread: the worker's torch thread and the HTTP process have the other cores.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler.compile_json_schema(schema, **GRAMMAR_OPTIONS)


def _json_tokens(decoded_vocab: list[bytes], vocab_size: int) -> torch.Tensor:
    """Bitmask of the tokens without a raw control byte (below 0x20).

    xgrammar 0.2.9 lets a length-bounded string (``maxLength``/``minLength``) take raw control
    characters, which JSON forbids; with our compact separators no valid output holds one anywhere,
    so masking them out is exact. Tokens past the tokenizer's (a padded vocabulary) stay set here:
    the grammar's own mask already excludes them.
    """
    words = -(-vocab_size // 32)
    allowed = np.ones(words * 32, dtype=bool)
    for token_id, text in enumerate(decoded_vocab[:vocab_size]):
        allowed[token_id] = not any(b < 0x20 for b in text)
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32).copy())
