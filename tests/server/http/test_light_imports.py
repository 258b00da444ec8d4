"""The HTTP process spawns its workers before it imports torch, transformers or xgrammar
(server/http/heavy_imports.py): importing the app, the CLI (which a spawned worker re-imports as its main
module) and the pool must not pull them in."""

import json
import subprocess
import sys
import threading

import pytest

from tests.server.conftest import REPO_ROOT
from xinserve.server.http import heavy_imports

HEAVY = ("torch", "transformers", "xgrammar", "sympy", "safetensors")


@pytest.mark.parametrize("module", ["xinserve.server.app", "xinserve.server.cli.main", "xinserve.server.pool.model_pool", "xinserve.server.api.openai.protocol"])
def test_importing_the_http_side_leaves_the_heavy_modules_out(module):
    # A fresh interpreter: this test process has imported torch long ago.
    code = f"import json, sys, {module}; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_load_imports_under_the_lock_and_returns_the_module():
    assert heavy_imports.load("json") is json
    # A module not yet imported waits for the lock (here held by another importer).
    sys.modules.pop("colorsys", None)
    loaded: list = []
    with heavy_imports.IMPORT_LOCK:
        thread = threading.Thread(target=lambda: loaded.append(heavy_imports.load("colorsys")))
        thread.start()
        thread.join(0.2)
        assert thread.is_alive() and not loaded
    thread.join(30)
    assert loaded == [sys.modules["colorsys"]]


def test_loading_a_tokenizer_imports_xgrammar_too(stories_dir):
    # The first response_format request checks its schema on the event loop: xgrammar must be imported by
    # then, in the thread that loads the tokenizer while the workers start (server/pool/model_pool.py).
    code = ("import json, sys; from xinserve.server.pool.model_pool import load_tokenizer; "
            f"tok = load_tokenizer({str(stories_dir)!r}); "
            "print(json.dumps([type(tok).__name__, 'xgrammar' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    name, imported = json.loads(out.stdout.splitlines()[-1])
    assert "Tokenizer" in name and imported
