"""docker-compose.yml: ``docker-compose config`` (Debian's docker-compose; no Docker engine needed)
accepts the file alone and with each profile, and the services carry what each needs: the vendors'
device nodes, driver mounts or runtime, Prometheus' config, Grafana's provisioning and dashboard.
``promtool`` (Debian's prometheus package) checks config/prometheus.yml."""

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PROFILES = ((), ("ascend",), ("musa",), ("ascend", "musa"), ("gateway",), ("pd",))
PROFILE_OF = {"xinserve-ascend": "ascend", "xinserve-musa": "musa", "xinserve-replica-1": "gateway",
              "xinserve-replica-2": "gateway", "sglang-router": "gateway", "xinserve-prefill": "pd",
              "xinserve-decode": "pd", "pd-proxy": "pd"}


def compose_config(*profiles: str) -> dict[str, Any]:
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is missing: apt-get install docker-compose (.ci/run does it)"
    args = [binary, "--project-directory", str(REPO), "-f", str(REPO / "docker-compose.yml")]
    for profile in profiles:
        args += ["--profile", profile]
    proc = subprocess.run([*args, "config"], capture_output=True, text=True, timeout=120, check=False,
                          env={"PATH": "/usr/bin:/bin"})  # no XINSERVE_* from the environment
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.mark.parametrize("profiles", PROFILES, ids=lambda p: "+".join(p) or "default")
def test_compose_file_is_valid_with_each_profile(profiles):
    services = compose_config(*profiles)["services"]
    assert {"xinserve", "prometheus", "grafana"} <= set(services)
    for name, service in services.items():
        wanted = PROFILE_OF.get(name)
        assert service.get("profiles", []) == ([wanted] if wanted else []), name


def test_a_compose_error_is_caught(tmp_path):
    # The validation is real: docker-compose rejects a misspelt key (so the tests above mean something).
    broken = tmp_path / "docker-compose.yml"
    broken.write_text((REPO / "docker-compose.yml").read_text().replace("runtime: mthreads", "runtme: mthreads"))
    proc = subprocess.run([shutil.which("docker-compose"), "-f", str(broken), "--profile", "musa", "config"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and "runtme" in proc.stderr


def test_vendor_services_get_devices_drivers_and_runtime():
    services = compose_config("ascend", "musa")["services"]
    ascend = services["xinserve-ascend"]
    devices = {d.split(":")[0] if isinstance(d, str) else d["source"] for d in ascend["devices"]}
    assert {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= devices
    assert any(d.startswith("/dev/davinci") and d[len("/dev/davinci"):].isdigit() for d in devices)
    sources = {v["source"] if isinstance(v, dict) else v.split(":")[0] for v in ascend["volumes"]}
    assert "/usr/local/Ascend/driver" in sources
    musa = services["xinserve-musa"]
    assert musa["runtime"] == "mthreads" and musa["environment"]["MTHREADS_VISIBLE_DEVICES"] == "all"
    for name, config in (("xinserve-ascend", "ascend.yaml"), ("xinserve-musa", "musa.yaml")):
        assert services[name]["command"] == ["serve", "--config", f"/app/config/{config}"]
        assert services[name]["build"]["args"]["TORCH_SPEC"] == ""  # keep the vendor image's torch
        assert (REPO / "config" / config).is_file()


def volume(v: str | dict[str, Any]) -> tuple[str, str, bool]:
    """(source, target, read-only) of a volume in either of docker-compose's spellings."""
    if isinstance(v, dict):
        return v["source"], v["target"], bool(v.get("read_only"))
    source, target, *mode = v.split(":")
    return source, target, mode == ["ro"]


def test_gateway_profile_puts_the_sglang_router_in_front_of_two_replicas():
    services = compose_config("gateway")["services"]
    router = services["sglang-router"]
    command = router["command"]
    urls = command[command.index("--worker-urls") + 1 : command.index("--policy")]
    replicas = [u.removeprefix("http://").split(":")[0] for u in urls]
    assert replicas == ["xinserve-replica-1", "xinserve-replica-2"]
    for name in replicas:
        # The same server as the default service, and the cache volume the gateway reads the tokenizer from.
        assert services[name]["image"] == services["xinserve"]["image"]
        assert services[name]["command"] == services["xinserve"]["command"]
        assert [volume(v) for v in services[name]["volumes"]] == [("xinserve-cache", "/cache", False)]
        assert "ports" not in services[name]  # reached through the gateway only
    assert command[command.index("--policy") + 1] == "cache_aware"
    assert [volume(v) for v in router["volumes"]] == [("xinserve-cache", "/cache", True)]
    assert [(p["published"], p["target"]) for p in router["ports"]] == [(8010, 30000)]
    dockerfile = (Path(router["build"]["context"]) / "Dockerfile").read_text()
    assert "sglang-router==" in dockerfile and "EXPOSE 30000" in dockerfile


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> host path, for bind mounts of files in this repository."""
    out = {}
    for v in service["volumes"]:
        source, target = (v["source"], v["target"]) if isinstance(v, dict) else v.split(":")[:2]
        if source.startswith(str(REPO)):
            out[target] = Path(source)
    return out


def test_prometheus_and_grafana_are_provisioned_from_this_repo():
    services = compose_config()["services"]
    prometheus = mounts(services["prometheus"])
    config_path = next(a.split("=", 1)[1] for a in services["prometheus"]["command"] if a.startswith("--config.file="))
    prom_config = prometheus[config_path]
    jobs = yaml.safe_load(prom_config.read_text())["scrape_configs"]
    targets = [t for job in jobs for group in job.get("static_configs", []) for t in group["targets"]]
    # Scaled services (the pd profile) are found by DNS: every replica, however many.
    assert [(name, group["port"]) for job in jobs for group in job.get("dns_sd_configs", [])
            for name in group["names"]] == [("xinserve-prefill", 8000), ("xinserve-decode", 8000)]
    assert {"xinserve:8000", "xinserve-ascend:8000", "xinserve-musa:8000", "xinserve-replica-1:8000",
            "xinserve-replica-2:8000"} == set(targets)
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (.ci/run does it)"
    checked = subprocess.run([promtool, "check", "config", str(prom_config)], capture_output=True, text=True,
                             timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    grafana = mounts(services["grafana"])
    provisioning = grafana["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["url"] == "http://prometheus:9090" and datasource["type"] == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "xinserve.yml").read_text())["providers"]
    dashboards = grafana[provider["options"]["path"]]
    dashboard = json.loads((dashboards / "xinserve.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {datasource["uid"]}
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("throughput", "first token", "inter-token", "running / waiting", "kv-cache", "preemptions",
                  "prefix-cache", "worker ready", "restarts", "4xx / 5xx"):
        assert topic in titles, topic


def test_every_server_keeps_its_caches_in_the_named_volume_the_image_can_warm():
    # The image's cache dir (embedded model, C++ build, inductor, decode buckets) is one named volume,
    # shared by the services, so a warm-up survives restarts and is done once for the replicas.
    text = (REPO / "Dockerfile").read_text()
    cache = re.search(r"XINSERVE_CACHE_DIR=(\S+)", text).group(1)
    config = compose_config("ascend", "musa", "gateway", "pd")
    assert "xinserve-cache" in config["volumes"]
    servers = [s for name, s in config["services"].items() if name.startswith("xinserve")]
    assert len(servers) == 7  # the default, ascend, musa, two gateway replicas, prefill, decode
    for service in servers:
        assert ("xinserve-cache", cache, False) in [volume(v) for v in service["volumes"]]
    # The optional build-time warm-up (WARMUP=1) writes there before VOLUME: Docker throws away what a
    # RUN writes into a path already declared a volume. Off by default.
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    warmup = next(i for i, line in enumerate(lines) if "xinserve warmup" in line)
    assert lines[warmup].startswith("RUN") and 'if [ -n "$WARMUP" ]' in lines[warmup]
    assert warmup < next(i for i, line in enumerate(lines) if line.startswith(f'VOLUME ["{cache}"]'))
    assert 'ARG WARMUP=""' in lines
    assert lines.index("USER xinserve") < warmup  # the caches belong to the user that serves
