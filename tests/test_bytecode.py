"""Every process the suite starts keeps the bytecode it compiles (tests/conftest.py), so the next
one reads torch's and transformers' modules compiled instead of compiling them again."""

import importlib.util
import json
import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_a_process_started_by_the_suite_leaves_its_modules_compiled():
    # A fresh interpreter, as a server, worker or rank is; xinserve.server.http.heavy_imports imports nothing heavy.
    code = ("import json, sys, importlib.util, xinserve.server.http.heavy_imports as m; "
            "print(json.dumps([sys.dont_write_bytecode, importlib.util.cache_from_source(m.__file__)]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    dont_write, cached = json.loads(out.stdout.splitlines()[-1])
    assert dont_write is False
    assert cached == importlib.util.cache_from_source(str(REPO_ROOT / "server" / "http" / "heavy_imports.py"))
    assert importlib.util.find_spec("xinserve.server.http.heavy_imports").cached == cached
    with open(cached, "rb") as f:
        assert f.read(4) == importlib.util.MAGIC_NUMBER
