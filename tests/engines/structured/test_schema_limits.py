"""The static bounds of a JSON schema, checked before any compile, and the digest-keyed caches."""

import json

import pytest

from xinserve.engines.structured.digest_cache import ENTRY_OVERHEAD_BYTES, DigestCache, schema_digest
from xinserve.engines.structured.limits import (
    DEFAULT_LIMITS,
    SchemaTooCostly,
    check_schema_shape,
    check_schema_size,
)
from xinserve.engines.structured.pattern_cost import expanded_size
from xinserve.engines.structured.schema import _verdicts, check_json_schema


@pytest.mark.parametrize(("pattern", "size"), [
    ("abc", 3),
    ("c{8000}", 8000),
    ("(a{30}){30}", 900),  # nested counts multiply
    ("(?:ab|cd){10}", 40),  # every alternative is unrolled
    (r"\d{3}-\d{4}", 8),
    ("a{2,5}", 5),
    ("a{2,}", 3),  # n copies and a loop
    ("[a-z{}]{5}", 5),  # braces inside a class are characters
    (r"\{5\}", 3),  # escaped braces are characters
    (r"\u0041{3}", 3),
    ("a*b+c?", 3),  # loops are not copies
    ("(ab", 2),  # an unclosed group counts as closed
])
def test_pattern_expanded_size(pattern, size):
    assert expanded_size(pattern) == size


def test_costly_patterns_are_refused_naming_the_bound():
    with pytest.raises(SchemaTooCostly, match="patterns repeat to 8000 atoms"):
        check_schema_shape({"type": "string", "pattern": "c{8000}"})
    with pytest.raises(SchemaTooCostly, match="patterns repeat to 2500"):
        check_schema_shape({"type": "string", "pattern": "(a{50}){50}"})
    # Summed over the schema: many cheap patterns add up.
    many = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "x{100}"} for i in range(11)}}
    with pytest.raises(SchemaTooCostly, match="repeat to 1100"):
        check_schema_shape(many)
    with pytest.raises(SchemaTooCostly, match="repeat"):
        check_schema_shape({"type": "object", "patternProperties": {"k{5000}": {"type": "string"}}})
    check_schema_shape({"type": "string", "pattern": r"^\d{3}-\d{4}$"})
    # A property named "pattern" is a schema, not a regex.
    check_schema_shape({"type": "object", "properties": {"pattern": {"type": "string"}}})


def test_size_depth_and_properties_are_bounded():
    with pytest.raises(SchemaTooCostly, match=f"more than the {DEFAULT_LIMITS.max_bytes} allowed"):
        check_schema_size(json.dumps({"enum": ["x" * DEFAULT_LIMITS.max_bytes]}))
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    with pytest.raises(SchemaTooCostly, match="nests 41 levels deep"):
        check_schema_shape(deep)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
    with pytest.raises(SchemaTooCostly, match="300 properties"):
        check_schema_shape(wide)
    # Counted lengths compile to a repeat whose cost does not grow with the count: not bounded.
    check_schema_shape({"type": "array", "items": {"type": "string", "maxLength": 10**6}, "minItems": 10**5})


def test_the_check_refuses_a_costly_pattern_and_caches_digests_not_schemas():
    with pytest.raises(ValueError, match="repeat to 8000"):
        check_json_schema(json.dumps({"type": "string", "pattern": "c{8000}"}))
    before = _verdicts.size_bytes
    for i in range(24):  # distinct schemas near the size bound: their text is not kept
        check_json_schema(json.dumps({"type": "string", "description": f"{i}" + "d" * 60_000}))
    assert _verdicts.size_bytes - before <= 24 * ENTRY_OVERHEAD_BYTES
    with pytest.raises(ValueError, match="bytes, more than"):
        check_json_schema(json.dumps({"type": "string", "description": "d" * 2_000_000}))


def test_digest_cache_evicts_the_least_recently_used_by_size():
    cache: DigestCache[str] = DigestCache(budget_bytes=3 * (100 + ENTRY_OVERHEAD_BYTES))
    keys = [schema_digest(f"schema {i}") for i in range(4)]
    for k in keys[:3]:
        cache.put(k, "v", 100)
    assert cache.get(keys[0]) == "v"  # now the most recently used
    cache.put(keys[3], "v", 100)
    assert keys[1] not in cache and all(k in cache for k in (keys[0], keys[2], keys[3]))
    assert cache.size_bytes == 3 * (100 + ENTRY_OVERHEAD_BYTES)
    cache.resize(keys[0], 250)  # a compile finished bigger than first counted: others make room
    assert keys[0] in cache and cache.size_bytes <= cache.budget_bytes and len(cache) == 2
    cache.put(schema_digest("huge"), "v", 10_000)  # over the whole budget: not kept, nothing evicted
    assert len(cache) == 2 and cache.size_bytes <= cache.budget_bytes
