"""Checking a JSON schema before any request uses it: the same check in the HTTP process (a 400) and
in the engine (a ValueError). The static bounds (``limits.py``) come first and keep the rest cheap:
xgrammar's tokenizer-free conversion costs at most about 0.1 s within them. The tokenizer-specific
compile runs in the worker (``engines/structured/compiler.py``). xgrammar is imported on the first
check: it imports torch and transformers, which the HTTP process loads after spawning its workers
(``server/http/heavy_imports.py``)."""

import json
import re
import threading

from xinserve.engines.structured.digest_cache import DigestCache, schema_digest
from xinserve.engines.structured.limits import (
    DEFAULT_LIMITS,
    SchemaTooCostly,
    check_schema_shape,
    check_schema_size,
)

# How every schema is turned into a grammar. Compact separators, no free whitespace: a small model
# left free to emit whitespace between JSON tokens can fill max_tokens with it. Strict: no
# properties or items beyond those a schema names (what OpenAI's strict structured outputs mean).
GRAMMAR_OPTIONS = {"any_whitespace": False, "strict_mode": True}

# xgrammar's messages start with a time stamp and its C++ source location.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


# Verdicts of checked schemas: digest -> None (enforceable) or the reason it is not. Shared by the
# HTTP process's threads, hence the lock.
_verdicts: DigestCache[str | None] = DigestCache(DEFAULT_LIMITS.check_cache_bytes)
_verdicts_lock = threading.Lock()


def check_json_schema(schema: str) -> None:
    """Raise ValueError naming the problem unless ``schema`` is a JSON Schema we can enforce."""
    digest = schema_digest(schema)
    with _verdicts_lock:
        known = digest in _verdicts
        reason = _verdicts.get(digest)
    if not known:
        reason = _verdict(schema)
        with _verdicts_lock:
            _verdicts.put(digest, reason, len(reason or ""))
    if reason is not None:
        raise ValueError(reason)


def _verdict(schema: str) -> str | None:
    """None when ``schema`` can be enforced, else why not; the cheap static checks first."""
    try:
        check_schema_size(schema)
        parsed = json.loads(schema)
        if not isinstance(parsed, dict):
            return "the JSON schema must be a JSON object"
        check_schema_shape(parsed)
    except SchemaTooCostly as exc:
        return str(exc)
    except json.JSONDecodeError as exc:
        return f"the JSON schema is not valid JSON: {exc}"
    except RecursionError:
        return "the JSON schema nests too deeply"
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(schema, **GRAMMAR_OPTIONS)
    except Exception as exc:  # noqa: BLE001  xgrammar raises RuntimeError and its own types
        return f"unsupported JSON schema: {_LOCATION.sub('', str(exc)).strip()}"
    return None
