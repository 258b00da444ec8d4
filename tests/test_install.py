"""The three ways people run xinserve: from the checkout root (``python -m`` / ``python -c``), the console
script, and a regular install as the Dockerfile makes it. Our folders are imported as ``xinserve.*`` only,
so Hugging Face's ``kernels`` (which transformers imports) and ours never meet."""

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run(cmd: list[str], cwd: Path, timeout: float = 120, env: dict | None = None) -> str:
    done = subprocess.run(cmd, check=False, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{shlex.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_hugging_faces_kernels_and_ours_import_side_by_side_from_the_checkout_root():
    code = (
        "import json, kernels, transformers.integrations.hub_kernels\n"
        "from kernels import CUDAProperties\n"
        "from importlib.metadata import distribution\n"
        "import xinserve.kernels.registry as ours\n"
        "print(json.dumps({'theirs': kernels.__file__, 'ours': ours.__file__,\n"
        "    'dist': str(distribution('kernels').locate_file('kernels/__init__.py'))}))\n"
    )
    found = json.loads(run([sys.executable, "-c", code], cwd=REPO_ROOT).splitlines()[-1])
    assert Path(found["theirs"]).resolve() == Path(found["dist"]).resolve()
    assert not Path(found["theirs"]).resolve().is_relative_to(REPO_ROOT / "kernels")
    assert Path(found["ours"]).name == "registry.py"


def test_the_cli_runs_as_a_module_from_the_checkout_root_and_as_the_console_script():
    assert "serve" in run([sys.executable, "-m", "xinserve.server.cli", "--help"], cwd=REPO_ROOT)
    assert "serve" in run([str(BIN / "xinserve"), "--help"], cwd=Path("/"))


def dockerfile() -> tuple[list[str], list[str]]:
    """The files the Dockerfile copies into its build (sources of ``COPY``), and its ``pip install`` of
    xinserve itself (the one that installs ``.``)."""
    text = re.sub(r"\\\n", " ", (REPO_ROOT / "Dockerfile").read_text())
    copied, install = [], []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["COPY"]:
            copied += words[1:-1]
        elif words[:1] == ["RUN"]:
            for command in " ".join(words[1:]).split("&&"):
                # the image's default build: an optional extra (``${WITH_MOONCAKE:+[mooncake]}``) is off
                args = [re.sub(r"\$\{\w+:\+[^}]*\}", "", arg) for arg in shlex.split(command)]
                if args[:2] == ["pip", "install"] and "." in args:
                    install = args
    return copied, install


def test_the_dockerfile_installs_every_folder_with_the_lock():
    copied, install = dockerfile()
    assert {"pyproject.toml", "setup.py", "requirements.lock", "server", "engines", "kernels", "config"} <= set(copied)
    assert install[install.index("-c") + 1] == "requirements.lock"


def shared_files(site_packages: Path) -> dict[str, list[str]]:
    """Each path that more than one installed distribution's RECORD claims, with their names."""
    owners = defaultdict(list)
    for record in site_packages.glob("*.dist-info/RECORD"):
        for line in record.read_text().splitlines():
            path = line.split(",")[0]
            if path and "__pycache__" not in path:
                owners[os.path.normpath(site_packages / path)].append(record.parent.name)
    return {path: names for path, names in owners.items() if len(names) > 1}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_the_dockerfile_install_in_a_fresh_venv_owns_its_files_and_serves_from_anywhere(tmp_path, stories_dir):
    """The Dockerfile's build context (what it copies) installed with its own pip command into a fresh venv:
    no file shared with another distribution, and ``xinserve serve`` run outside the checkout answers."""
    copied, install = dockerfile()
    context = tmp_path / "context"
    context.mkdir()
    for name in copied:
        source = REPO_ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, context / name)
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    torch_version = run([sys.executable, "-c", "import torch; print(torch.__version__)"], cwd=tmp_path).strip()
    run([*pip, f"torch=={torch_version.split('+')[0]}"], cwd=tmp_path, timeout=600)
    run([*pip, *install[2:]], cwd=context, timeout=900)

    site_packages = next(venv.glob("lib/python*/site-packages"))
    assert shared_files(site_packages) == {}
    record = next(site_packages.glob("xinserve-*.dist-info/RECORD")).read_text().splitlines()
    tops = {line.split(",")[0].split("/")[0] for line in record}
    assert {top for top in tops if not top.startswith(("xinserve", ".."))} == set()
    assert any(line.startswith("xinserve/config/default.yaml,") for line in record)

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen([str(venv / "bin" / "xinserve"), "serve", "--model", str(stories_dir), "--host",
                             "127.0.0.1", "--port", str(port)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"].strip()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
