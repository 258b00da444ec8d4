"""Imports run one way: server -> engines -> kernels, never back up, and no module imports itself
through others. Every import counts, at any depth of a file (inside functions and ``TYPE_CHECKING``
blocks too): a lazy import is still a dependency, it only fails later."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("server", "engines", "kernels")  # highest first: each may import only those after it
RANK = {name: rank for rank, name in enumerate(reversed(PACKAGES))}


def module_name(path: Path) -> str:
    """``engines/core/kv_cache.py`` -> ``xinserve.engines.core.kv_cache``: the folders install under one namespace."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(["xinserve", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def package_of(module: str) -> str:
    return module.split(".")[1]


def modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` (at ``path``) imports: ``from a import b`` names module a.b when
    there is one, else a itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # module -> "open" while on the path, "done" after
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_no_package_imports_a_higher_one():
    upward = sorted(
        f"{source} imports {target}"
        for source, targets in import_graph().items()
        for target in targets
        if RANK[package_of(target)] > RANK[package_of(source)]
    )
    assert upward == []


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": {"b2"}, "b2": {"b"}}, ["b", "b2", "b"]),
])
def test_find_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


def test_every_import_of_our_folders_names_the_xinserve_namespace():
    """``import kernels`` from the checkout root would find Hugging Face's ``kernels`` (or shadow it): our
    folders are imported only as ``xinserve.server``, ``xinserve.engines``, ``xinserve.kernels``."""
    bare = []
    for path in sorted(path for folder in (*PACKAGES, "tests", "benchmarks") for path in (ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bare += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                     if name.split(".")[0] in (*PACKAGES, "config")]
    assert bare == []


# A folder that grows past this is split by role (docs/architecture.md); models/ holds one file per
# architecture and is the one exception.
MAX_FOLDER_ENTRIES = 20
ONE_FILE_PER_ARCHITECTURE = ("engines/models",)


def test_no_source_folder_holds_more_than_about_twenty_entries():
    crowded = []
    for package in PACKAGES:
        for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if p.is_dir())]:
            entries = [p for p in folder.iterdir() if p.name != "__pycache__"]
            name = str(folder.relative_to(ROOT))
            if "__pycache__" not in folder.parts and name not in ONE_FILE_PER_ARCHITECTURE \
                    and len(entries) > MAX_FOLDER_ENTRIES:
                crowded.append(f"{name}: {len(entries)} entries")
    assert crowded == []


def test_models_do_not_import_quantization():
    """Quantization swaps layers of the models (it imports them); loading a checkpoint, which needs both,
    lives beside them (engines/model_loader.py), so the two packages never import each other."""
    back = sorted(f"{source} imports {target}" for source, targets in import_graph().items()
                  if source.startswith("xinserve.engines.models")
                  for target in targets if target.startswith("xinserve.engines.quantization"))
    assert back == []
