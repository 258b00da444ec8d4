"""What a JSON schema costs xgrammar, by the shape that drives it: the numbers behind ``engines/structured/limits.py``.

For each schema it measures ``check_ms`` (the tokenizer-free ``Grammar.from_json_schema``, the HTTP
process's check), ``compile_ms`` (a worker's compile against the stories260K vocabulary, 512 tokens)
and ``compiled_kb`` (the compiled grammar's memory), and whether the static bounds let it through.
Shapes: a counted repetition in a ``pattern`` (cost grows with the square of the count), objects
with N properties (optional, as strict mode writes them), and ``maxLength``/``maxItems`` counts
(a repeat construct: the count does not change the cost).

Prints a markdown table and writes ``benchmarks/results/schema_costs.json``. The committed result:

    python benchmarks/schema_costs.py    # about a minute on 2 cores

Smoke run: the same with ``--out /tmp/schema_costs.json``.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

import xgrammar
from common import RESULTS, ROOT, write_result
from transformers import AutoTokenizer

from xinserve.engines.structured.limits import SchemaTooCostly, check_schema_shape, check_schema_size
from xinserve.engines.structured.schema import GRAMMAR_OPTIONS


def schemas() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for n in (100, 1000, 2000, 4000):
        out[f"pattern c{{{n}}}"] = {"type": "string", "pattern": f"c{{{n}}}"}
    out["pattern (a{30}){30}"] = {"type": "string", "pattern": "(a{30}){30}"}
    for n in (50, 100, 200, 256, 400):
        out[f"{n} optional properties"] = {
            "type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 20} for i in range(n)}}
    out["enum of 5000"] = {"enum": [f"v{i}" for i in range(5000)]}
    out["anyOf of 500"] = {"anyOf": [{"type": "string", "const": f"c{i}"} for i in range(500)]}
    for n in (10, 100_000):
        out[f"maxLength {n}"] = {"type": "string", "maxLength": n}
        out[f"maxItems {n}"] = {"type": "array", "items": {"type": "integer"}, "maxItems": n}
    return out


def allowed(text: str, schema: dict) -> str:
    try:
        check_schema_size(text)
        check_schema_shape(schema)
    except SchemaTooCostly as exc:
        return "no: " + str(exc).removeprefix("the JSON schema ").split(", more than")[0]
    return "yes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "schema_costs.json")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "tests" / "fixtures" / "stories260K")
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    rows = []
    for name, schema in schemas().items():
        text = json.dumps(schema)
        start = time.perf_counter()
        xgrammar.Grammar.from_json_schema(text, **GRAMMAR_OPTIONS)
        checked = time.perf_counter()
        compiled = compiler.compile_json_schema(text, **GRAMMAR_OPTIONS)
        done = time.perf_counter()
        rows.append({
            "schema": name, "bytes": len(text), "check_ms": round((checked - start) * 1e3, 2),
            "compile_ms": round((done - checked) * 1e3, 2), "compiled_kb": round(compiled.memory_size_bytes / 1024, 1),
            "allowed": allowed(text, schema),
        })
    print("| schema | bytes | check ms | compile ms | compiled KB | within the bounds |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['schema']} | {r['bytes']} | {r['check_ms']} | {r['compile_ms']} | {r['compiled_kb']} | {r['allowed']} |")
    write_result(args.out, {"vocab_size": len(tokenizer), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
