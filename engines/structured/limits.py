"""What a JSON schema may cost: static bounds checked before any compile, and the compile's deadline.

One place for every default (docs/api.md's "Structured output" section lists them). The bounds are
measured, not guessed (``benchmarks/schema_costs.py``): xgrammar's compile time grows with the square
of a pattern's unrolled repetitions and faster than linearly with an object's properties, while
``minLength``/``maxLength``/``minItems``/``maxItems`` compile to a counted repeat whose cost does not
depend on the count (1e5 costs what 10 does), so those are left unbounded.
"""

from dataclasses import dataclass
from typing import Any

from xinserve.engines.structured.pattern_cost import expanded_size


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    max_bytes: int = 64 * 1024  # the schema as compact JSON text
    max_depth: int = 32  # nesting of JSON objects and arrays in the schema document
    max_pattern_size: int = 1000  # atoms of all ``pattern`` regexes once counted repetitions unroll
    max_properties: int = 256  # entries of every ``properties`` object, summed
    compile_timeout_s: float = 10.0  # a worker's compile of one schema, from when it starts running
    compile_threads: int = 2  # a costly compile leaves the other threads to the rest
    check_cache_bytes: int = 1 << 20  # the HTTP-side check's verdicts, keyed by schema digest
    compiled_cache_bytes: int = 256 << 20  # a worker's compiled grammars, keyed by schema digest


DEFAULT_LIMITS = SchemaLimits()


class SchemaTooCostly(ValueError):  # a ValueError: the server answers 400
    """A schema over one of the static bounds; the message names the bound and the value."""


def check_schema_size(text: str, limits: SchemaLimits = DEFAULT_LIMITS) -> None:
    """Raise ``SchemaTooCostly`` when the schema's text is over the byte bound (before parsing it)."""
    size = len(text.encode())
    if size > limits.max_bytes:
        raise SchemaTooCostly(f"the JSON schema is {size} bytes, more than the {limits.max_bytes} allowed")


def check_schema_shape(schema: Any, limits: SchemaLimits = DEFAULT_LIMITS) -> None:
    """Raise ``SchemaTooCostly`` when the parsed ``schema`` nests, repeats or branches over a bound."""
    depth = patterns = properties = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]  # iterative: a deep schema must not recurse
    while stack:
        node, level = stack.pop()
        if isinstance(node, list | dict):
            depth = max(depth, level)
        if isinstance(node, list):
            stack.extend((item, level + 1) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                patterns += expanded_size(value)
            elif key == "patternProperties" and isinstance(value, dict):
                patterns += sum(expanded_size(k) for k in value)
            if key == "properties" and isinstance(value, dict):
                properties += len(value)
            stack.append((value, level + 1))
    if depth > limits.max_depth:
        raise SchemaTooCostly(f"the JSON schema nests {depth} levels deep, more than the {limits.max_depth} allowed")
    if patterns > limits.max_pattern_size:
        raise SchemaTooCostly(
            f"the JSON schema's patterns repeat to {patterns} atoms ({{n}} and {{n,m}} counts unrolled), "
            f"more than the {limits.max_pattern_size} allowed"
        )
    if properties > limits.max_properties:
        raise SchemaTooCostly(
            f"the JSON schema has {properties} properties, more than the {limits.max_properties} allowed"
        )
