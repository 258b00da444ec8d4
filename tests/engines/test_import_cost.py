"""Every worker, tensor-parallel rank and test process imports ``engines``: a package that only one
checkpoint format needs, and that costs seconds to import, is imported where that format is read,
never at a module's top level. (compressed_tensors pulls in accelerate and transformers' distributed
stack: ~5 CPU seconds per process, most of what importing ``xinserve.engines.core.engine`` cost.)"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Imported lazily by the one format that needs them.
HEAVY = ("compressed_tensors", "accelerate")


def top_level_imported(path: Path) -> set[str]:
    """Dotted names a module imports outside any function (at import time): ``import a.b`` gives
    ``a.b``, ``from a import b`` gives ``a.b``."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names.update(f"{child.module}.{alias.name}" for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names


def top_level_imports(path: Path) -> set[str]:
    """Root package names a module imports outside any function (at import time)."""
    return {name.split(".")[0] for name in top_level_imported(path)}


def test_top_level_imports_sees_module_and_class_level_but_not_function_bodies(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import a.b\nfrom c import d\nclass K:\n    import e\ndef f():\n    import g\n")
    assert top_level_imports(source) == {"a", "c", "e"}


def test_engines_and_kernels_import_no_heavy_format_package_at_import_time() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(top_level_imports(path) & set(HEAVY))
        for package in ("engines", "kernels") for path in (ROOT / package).rglob("*.py")
    }
    assert {path: names for path, names in offenders.items() if names} == {}


# What the HTTP process imports to build the embedded model on first use (server/embedded_model/resolve.py): a
# transformers model class costs ~10 CPU s of modelling code (factory.py's way of building models).
EMBEDDED_BUILD = ("server/embedded_model/resolve.py", "server/embedded_model/llama_files.py", "server/embedded_model/weights.py",
                  "server/embedded_model/build_once.py", "server/embedded_model/tokenizer.py")


def test_building_the_embedded_model_imports_no_model_class_nor_the_factory() -> None:
    imported = {name for path in EMBEDDED_BUILD for name in top_level_imported(ROOT / path)}
    assert {name for name in imported if name.startswith("xinserve.server.embedded_model.factory")} == set()
    model_classes = {name for name in imported if name.startswith("transformers.")
                     and name.endswith(("ForCausalLM", "PreTrainedModel", "Model"))}
    assert model_classes == set()
    assert "transformers.LlamaConfig" in imported  # the check sees what it looks for
