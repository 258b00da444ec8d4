"""Checking a JSON schema before any request uses it: the same check in the HTTP process (a 400) and
in the engine (a ValueError). Tokenizer-free, so it is cheap; the tokenizer-specific compile runs in
the worker (``engines/structured/compiler.py``)."""

import json
import re
from functools import lru_cache

import xgrammar

# How every schema is turned into a grammar. Compact separators, no free whitespace: a small model
# left free to emit whitespace between JSON tokens can fill max_tokens with it. Strict: no
# properties or items beyond those a schema names (what OpenAI's strict structured outputs mean).
GRAMMAR_OPTIONS = {"any_whitespace": False, "strict_mode": True}

# xgrammar's messages start with a time stamp and its C++ source location.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@lru_cache(maxsize=256)
def check_json_schema(schema: str) -> None:
    """Raise ValueError naming the problem unless ``schema`` is a JSON Schema we can enforce."""
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError("the JSON schema must be a JSON object")  # noqa: TRY004  ValueError: a 400
    try:
        xgrammar.Grammar.from_json_schema(schema, **GRAMMAR_OPTIONS)
    except Exception as exc:  # noqa: BLE001  xgrammar raises RuntimeError, ValueError and its own types
        raise ValueError(f"unsupported JSON schema: {_LOCATION.sub('', str(exc)).strip()}") from None
