"""docker-compose.yml's pd profile (prefill/decode disaggregation, docs/disaggregation.md): a prefill and a
decode instance on the Mooncake image behind the vLLM-protocol proxy. Each instance's shell command is run
here with stand-ins for ``hostname`` and ``xinserve`` and its arguments are fed to the server's own flag
parser, so the kv_transfer_config each side starts with (its role, its own address as kv_ip) is checked
as the server would read it; the proxy's flags are the proxy's own parser's."""

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.ops.test_compose import REPO, compose_config
from xinserve.server.cli.main import _add_serve_args, build_config
from xinserve.server.disagg import proxy

CONTAINER_IP = "10.1.2.3"


def served_argv(service: dict, tmp_path: Path) -> list[str]:
    """The ``xinserve`` arguments the service's shell command runs, in a container whose address is
    CONTAINER_IP."""
    assert service["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = service["command"]
    script = script.replace("$$", "$")  # compose's escape, as `docker-compose config` prints it
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("hostname", f'echo "{CONTAINER_IP}"'),
                       ("xinserve", 'python3 -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    proc = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=30, check=True,
                          env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def services() -> dict:
    return compose_config("pd")["services"]


@pytest.mark.parametrize(("name", "role"), [("xinserve-prefill", "kv_producer"), ("xinserve-decode", "kv_consumer")])
def test_each_side_starts_with_its_role_and_its_own_address(services, name, role, tmp_path):
    argv = served_argv(services[name], tmp_path)
    assert argv[:3] == ["serve", "--config", "/app/config/default.yaml"]
    argv[2] = str(REPO / "config" / "default.yaml")  # where the image has it
    parser = argparse.ArgumentParser()
    _add_serve_args(parser)
    (model,) = build_config(parser.parse_args(argv[1:]), env={}).models
    transfer = model.kv_transfer_config
    assert (transfer["kv_connector"], transfer["kv_role"], transfer["kv_ip"]) == ("MooncakeConnector", role, CONTAINER_IP)
    # Both sides serve the same model with the same block layout (the decode side refuses any other).
    assert services[name]["image"] == "xinserve:cpu-pd" and services[name]["build"]["args"] == {"WITH_MOONCAKE": "1"}
    assert "ports" not in services[name]  # reached through the proxy only; scaling needs no free host port


def test_the_proxy_sends_prefill_then_decode_to_the_two_services(services, monkeypatch):
    service = services["pd-proxy"]
    assert service["entrypoint"] == ["python", "-m", "xinserve.server.disagg.proxy"]
    seen = {}
    monkeypatch.setattr(proxy, "make_app", lambda prefill, decode: seen.update(prefill=prefill, decode=decode))
    monkeypatch.setattr(proxy.uvicorn, "run", lambda app, host, port, **_: seen.update(host=host, port=port))
    proxy.main(service["command"])
    assert seen == {"prefill": ["http://xinserve-prefill:8000"], "decode": ["http://xinserve-decode:8000"],
                    "host": "0.0.0.0", "port": 9000}
    assert [(p["published"], p["target"]) for p in service["ports"]] == [(8020, 9000)]
    assert set(service["depends_on"]) == {"xinserve-prefill", "xinserve-decode"}


def test_the_image_installs_the_transfer_engine_and_its_libraries():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert '".${WITH_MOONCAKE:+[mooncake]}"' in dockerfile
    assert "libibverbs1 libnuma1 libcurl4" in dockerfile
    assert 'ARG WITH_MOONCAKE=""' in dockerfile  # the default image stays without it
