"""``python -m xinserve.server.cli.bytecode`` (make's install step): the bytecode of what a server start
imports is written beside each source, where Python reads it even under PYTHONDONTWRITEBYTECODE."""

import importlib.util
import os
import subprocess
import sys

PROBE = """
import sys
from xinserve.server.cli import bytecode
bytecode.IMPORTS = ("probe_module", "not_installed_anywhere")
bytecode.PACKAGES = ("probe_package", "not_installed_either")
print(bytecode.compile_all())
"""


def test_the_imported_modules_and_whole_lazy_packages_are_byte_compiled(tmp_path, monkeypatch):
    (tmp_path / "probe_module.py").write_text("import probe_package\nVALUE = 1\n")
    package = tmp_path / "probe_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "lazy.py").write_text("VALUE = 2\n")  # never imported: compiled with its package
    (tmp_path / "unrelated.py").write_text("VALUE = 3\n")  # neither imported nor in a package listed
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("PYTHONPYCACHEPREFIX", None)  # beside the sources, as an install has them
    count = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True,
                           cwd=tmp_path).stdout.split()[-1]
    assert int(count) >= 3

    monkeypatch.setattr(sys, "pycache_prefix", None)  # the suite's own (tests/conftest.py) is not the install's

    def compiled(path):
        return os.path.exists(importlib.util.cache_from_source(str(path)))

    assert compiled(tmp_path / "probe_module.py") and compiled(package / "lazy.py") and compiled(package / "__init__.py")
    assert not compiled(tmp_path / "unrelated.py")
