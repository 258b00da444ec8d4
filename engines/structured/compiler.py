"""The worker's grammar compiler: JSON schema -> xgrammar ``CompiledGrammar``, in threads, cached.

The schema's text crosses from the HTTP process, not a compiled grammar: the compiled form depends
on this worker's vocabulary (the model's, padded beyond the tokenizer's) and stop tokens, the
offline ``LLM`` has no HTTP process to compile in, and a compiled grammar's size grows with the
vocabulary while the schema stays small. A request waits, outside the scheduler, until its grammar
is ready, so the step loop never runs a compile itself.

Threads, not processes: xgrammar releases the GIL while it compiles (a spinning Python thread kept
about two thirds of its pace beside a compile on two cores), so the step loop goes on; and a compiled
grammar is too costly to ship between processes (200 properties over a 32k vocabulary: 50 MB of JSON,
10 s to serialise). A thread cannot be stopped, so the static bounds (``limits.py``) keep every
compile short, and the engine fails a request whose compile runs past ``compile_timeout_s`` without
waiting for it. Several threads: one costly compile never holds up a cheap one queued after it.
"""

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xgrammar

from xinserve.engines.structured.digest_cache import DigestCache, schema_digest
from xinserve.engines.structured.limits import DEFAULT_LIMITS, SchemaLimits
from xinserve.engines.structured.schema import GRAMMAR_OPTIONS


@dataclass(slots=True)
class OutputGrammar:
    """One sequence's grammar state: its matcher, advanced by each token the sequence accepts and
    asked for the next token mask, and the worker's filter of JSON-safe tokens."""

    matcher: xgrammar.GrammarMatcher
    json_tokens: torch.Tensor  # [ceil(V / 32)] int32 bitmask, shared by the worker's grammars


class CompileTimeout(Exception):
    """A compile ran past its deadline; the request fails and the schema stays refused while cached."""


@dataclass(slots=True, eq=False)
class PendingGrammar:
    """One schema's compile, shared by every request that asks for the same schema while cached."""

    digest: bytes
    future: Future = field(default_factory=Future)  # of the xgrammar.CompiledGrammar
    started_at: float | None = None  # time.monotonic() when a thread began the compile
    counted: bool = False  # its compiled size is in the cache's budget

    def overdue(self, now: float, timeout_s: float) -> bool:
        """Still compiling more than ``timeout_s`` after it started (time queued does not count)."""
        return not self.future.done() and self.started_at is not None and now - self.started_at > timeout_s


class GrammarCompiler:
    """Compiles in ``limits.compile_threads`` threads; caches compiled grammars by schema digest within
    ``limits.compiled_cache_bytes``. Called from the engine's thread only."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], limits: SchemaLimits = DEFAULT_LIMITS
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self.limits = limits
        self._compiler: xgrammar.GrammarCompiler | None = None  # built in a thread on first use
        self._compiler_lock = threading.Lock()
        self._json_tokens: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(max_workers=limits.compile_threads, thread_name_prefix="grammar")
        self.cache: DigestCache[PendingGrammar] = DigestCache(limits.compiled_cache_bytes)

    def compile(self, schema: str) -> PendingGrammar:
        """The compile of ``schema`` (JSON text): the cached one unless it failed (but for a timeout),
        else a new one."""
        digest = schema_digest(schema)
        pending = self.cache.get(digest)
        if pending is not None and not (
            pending.future.done() and not isinstance(pending.future.exception(), CompileTimeout | None)
        ):
            return pending
        pending = PendingGrammar(digest)
        # Counted as its schema's size until compiled: ``account`` recounts it then.
        self.cache.put(digest, pending, len(schema))
        self._pool.submit(self._run, schema, pending)
        return pending

    def account(self, pending: PendingGrammar) -> None:
        """Count a finished compile at its compiled size, once, if it is still the cached one."""
        if pending.counted or pending.future.exception() is not None:
            return
        pending.counted = True
        if self.cache.get(pending.digest) is pending:
            self.cache.resize(pending.digest, pending.future.result().memory_size_bytes)

    def expire(self, pending: PendingGrammar, reason: str) -> PendingGrammar:
        """Give up on a compile past its deadline; returns the failed compile that replaces it, so
        that the same schema fails at once while cached (its thread finishes on its own, unwaited)."""
        failed = PendingGrammar(pending.digest, started_at=pending.started_at)
        failed.future.set_exception(CompileTimeout(reason))
        if self.cache.get(pending.digest) is pending:
            self.cache.put(pending.digest, failed, 0)
        return failed

    def new_grammar(self, compiled: xgrammar.CompiledGrammar) -> OutputGrammar:
        """A fresh state for one sequence (each choice of an n > 1 request has its own)."""
        assert self._json_tokens is not None  # set by the compile that produced ``compiled``
        return OutputGrammar(xgrammar.GrammarMatcher(compiled), self._json_tokens)

    def _run(self, schema: str, pending: PendingGrammar) -> None:
        pending.started_at = time.monotonic()
        try:
            compiled = self._xgrammar_compiler().compile_json_schema(schema, **GRAMMAR_OPTIONS)
        except Exception as exc:  # noqa: BLE001  handed to the request through its future
            pending.future.set_exception(exc)
        else:
            pending.future.set_result(compiled)

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._json_tokens = _json_tokens(info.decoded_vocab, self._vocab_size)
                # One thread per compile: the worker's torch thread and the HTTP process have the others.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


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
