"""Shared fixtures: tiny offline models built once per test session, and stories260K from tests/fixtures."""

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Tests never reach the Hub, and the tokenizers thread pool would warn after every fork.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# Triton kernels run on CPU tensors under Triton's interpreter; set for the whole session (it is read
# when kernels.triton is imported) so no test's outcome depends on which test imported it first.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Compiling decode buckets costs seconds per engine: only tests/engines/worker/test_decode_graphs.py (which
# asks for it) compiles; every other engine, in-process or a server's worker, decodes eagerly.
os.environ.setdefault("XINSERVE_COMPILE", "off")
# The C++ CPU kernels build once per machine (~30 s): tests that point XINSERVE_CACHE_DIR at a fresh directory
# (for fresh kernel timings, or a fresh embedded model) still load the one build: the install's, in the venv
# (kernels/cpu/cpp_build.py ``installed_dir``: make's install step builds it; if it did not, the first test builds it there).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "share", "xinserve", "torch_extensions"))
# Compiled bytecode: where the environment sets PYTHONDONTWRITEBYTECODE (this machine's does) over a venv
# installed without byte-compiling (the Makefile's --no-compile), no module has a .pyc and every process
# the suite starts (xdist workers, servers, their workers and ranks: hundreds) compiles all it imports
# from source: 9.5 CPU s for a worker's imports and tokenizer, 3.9 s with bytecode (docs/testing.md).
# The suite keeps what it compiles in a directory of its own, beside neither the sources nor
# the venv; every process started from here reads it (PYTHONPYCACHEPREFIX).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), f"xinserve-pycache-{os.getuid()}"))
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
    sys.dont_write_bytecode = False
# Under pytest-xdist each worker gets its share of the cores for torch (set before torch is imported;
# servers started by tests pick their own threads), so two workers on two cores do not oversubscribe.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _XDIST_WORKERS)))

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # so a bare `pytest` imports the in-tree packages too
    sys.path.insert(0, str(REPO_ROOT))

STORIES_DIR = REPO_ROOT / "tests" / "fixtures" / "stories260K"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", type=Path, metavar="PATH",
                     help="write CPU seconds per test file and shared fixture to PATH (tests/cpu_times.py)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("cpu_report"):
        from tests.cpu_times import CpuTimes

        config.pluginmanager.register(CpuTimes(config.getoption("cpu_report")), "cpu_times")


def pytest_unconfigure(config: pytest.Config) -> None:
    """pytest's own exit (each xdist worker's too) skips the walk over its heap (engines/worker/process_exit.py)."""
    from xinserve.engines.worker.process_exit import leave_quickly

    leave_quickly()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "xinserve_units_file" in getattr(config, "workerinput", {}):  # a worker of `make test`'s xdist
        from tests.xdist_groups import on_worker_collected

        on_worker_collected(config, items)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist's controller, per worker: where to write the units (tests/xdist_groups.py)."""
    from tests.xdist_groups import UNITS_KEY, units_file

    node.workerinput[UNITS_KEY] = str(units_file())


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` schedules units of files that share a server (tests/xdist_groups.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.xdist_groups import UnitScheduling

    return UnitScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``get(arch="llama", **kwargs) -> Path``: ``make_tiny_model`` memoised per (arch, kwargs)."""
    from xinserve.server.embedded_model.factory import make_tiny_model

    built: dict[str, Path] = {}

    def get(arch: str = "llama", **kwargs) -> Path:
        key = f"{arch}:{sorted(kwargs.items())!r}"  # repr: values such as dicts are unhashable
        if key not in built:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[key] = make_tiny_model(path, arch, **kwargs)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_models: Callable[..., Path]) -> Path:
    """The default tiny Llama (same shape as the server's embedded ``xinserve-tiny``)."""
    return tiny_models("llama")


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """Karpathy's stories260K Llama (a trained model: its greedy text is meaningful)."""
    # In the repository (tests/fixtures): a missing copy is a broken checkout, so fail, never skip.
    assert (STORIES_DIR / "config.json").is_file(), f"stories260K fixture missing at {STORIES_DIR}"
    return STORIES_DIR
