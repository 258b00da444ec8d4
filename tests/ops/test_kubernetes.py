"""The Kubernetes manifests (deploy/kubernetes): each overlay renders with ``kubectl kustomize``, every
object validates against Kubernetes' own schemas (kubernetes-validate, offline, strict), and the
pieces fit together: the HPA scales the Deployment on the metrics the adapter rules serve, the
probes hit /health and /health/live, the vendors' device-plugin resources are requested, the
ConfigMap is a config the server accepts with its keys from the Secret, the ServiceMonitor (a CRD
the validator does not know) selects the Service's metrics port, and every pod takes the warm path (an
init container running ``xinserve warmup`` into the cache volume the server reads, the server ready
only once warm). There is no cluster here: nothing is applied."""

import argparse
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from xinserve.server.cli.main import _add_serve_args, build_config
from xinserve.server.config import parse_config

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "ascend", "musa")
DEVICE_RESOURCE = {"cpu": None, "ascend": "huawei.com/Ascend910", "musa": "mthreads.com/gpu"}
# The oldest Kubernetes still commonly run, and the newest the validator knows.
VERSIONS = ("1.27.0", kubernetes_validate.latest_version())


def render(overlay: str | Path) -> list[dict[str, Any]]:
    """The objects of ``overlays/OVERLAY``, or of the kustomization in the directory ``overlay``."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is missing (it renders the Kustomize overlays)"
    directory = overlay if isinstance(overlay, Path) else ROOT / "overlays" / overlay
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, dict[str, dict[str, Any]]]:
    """(overlay, kind -> the one object of that kind)."""
    docs = render(request.param)
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), kinds
    return request.param, {d["kind"]: d for d in docs}


def container(objs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (c,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def test_every_object_validates_against_the_kubernetes_schemas(rendered):
    overlay, objs = rendered
    expected = {"Deployment", "Service", "ConfigMap", "Secret", "HorizontalPodAutoscaler", "ServiceMonitor"}
    if overlay != "cpu":
        expected.add("PersistentVolumeClaim")
    assert set(objs) == expected
    for kind, obj in objs.items():
        for version in VERSIONS:
            if kind == "ServiceMonitor":
                # A CRD: checked by hand below; make sure the validator is not silently passing it.
                with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                    kubernetes_validate.validate(obj, version, strict=True)
            else:
                kubernetes_validate.validate(obj, version, strict=True)


def test_a_broken_manifest_fails_validation(rendered):
    _, objs = rendered
    broken = yaml.safe_load(yaml.safe_dump(objs["HorizontalPodAutoscaler"]))
    broken["spec"]["minReplicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def test_hpa_scales_the_deployment_1_to_4_on_queue_and_kv_usage(rendered):
    _, objs = rendered
    hpa, deployment = objs["HorizontalPodAutoscaler"]["spec"], objs["Deployment"]
    assert hpa["scaleTargetRef"] == {"apiVersion": deployment["apiVersion"], "kind": "Deployment",
                                     "name": deployment["metadata"]["name"]}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 4)
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["metrics"]}
    assert set(targets) == {"xinserve_num_requests_waiting", "xinserve_kv_cache_usage_perc"}
    assert targets["xinserve_kv_cache_usage_perc"] == {"type": "AverageValue", "averageValue": "700m"}


def test_adapter_rules_serve_the_metrics_the_hpa_reads(rendered):
    _, objs = rendered
    adapter = yaml.safe_load((ROOT / "prometheus-adapter" / "config.yaml").read_text())
    kubernetes_validate.validate(adapter, VERSIONS[-1], strict=True)
    served = set()
    for rule in yaml.safe_load(adapter["data"]["config.yaml"])["rules"]:
        # Either metric prefix (metrics.prefix) gives the HPA the same metric name.
        prefixes, metric = re.match(r'\{__name__=~"\(([\w|]+)\):(\w+)"', rule["seriesQuery"]).groups()
        assert set(prefixes.split("|")) == {"xinserve", "vllm"}
        names = {re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), f"{p}:{metric}")
                 for p in prefixes.split("|")}
        assert len(names) == 1, names
        served |= names
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}  # per-pod metrics
    assert {m["pods"]["metric"]["name"] for m in objs["HorizontalPodAutoscaler"]["spec"]["metrics"]} <= served


def test_probes_port_and_device_resources(rendered):
    overlay, objs = rendered
    c = container(objs)
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "http"}
    assert c["ports"] == [{"name": "http", "containerPort": 8000}]
    assert c["image"] == {"cpu": "xinserve:cpu", "ascend": "xinserve:npu", "musa": "xinserve:musa"}[overlay]
    resource = DEVICE_RESOURCE[overlay]
    devices = {k for part in c["resources"].values() for k in part if "/" in k}
    if resource is None:
        assert devices == set()
    else:
        assert c["resources"]["limits"][resource] == c["resources"]["requests"][resource] == 1
        assert devices == {resource}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in objs["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert set(mounts.values()) == set(volumes)
    assert volumes[mounts["/etc/xinserve"]]["configMap"]["name"] == objs["ConfigMap"]["metadata"]["name"]
    if overlay != "cpu":
        claim = volumes[mounts["/data/models"]]["persistentVolumeClaim"]["claimName"]
        assert claim == objs["PersistentVolumeClaim"]["metadata"]["name"]
    if overlay == "ascend":
        assert volumes[mounts["/usr/local/Ascend/driver"]]["hostPath"]["path"] == "/usr/local/Ascend/driver"


def test_config_map_is_a_server_config_with_keys_from_the_secret(rendered, monkeypatch):
    overlay, objs = rendered
    c = container(objs)
    assert [s["secretRef"]["name"] for s in c["envFrom"]] == [objs["Secret"]["metadata"]["name"]]
    for name, value in objs["Secret"]["stringData"].items():
        monkeypatch.setenv(name, value)
    assert c["args"] == ["serve", "--config", "/etc/xinserve/config.yaml", "--ready-when-warm"]
    config = parse_config(yaml.safe_load(objs["ConfigMap"]["data"]["config.yaml"]), f"{overlay} ConfigMap")
    assert [k.name for k in config.server.named_keys()] == ["default"]
    assert config.server.shutdown_timeout_s < objs["Deployment"]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]
    device = {"cpu": "cpu", "ascend": "npu:0", "musa": "musa:0"}[overlay]
    assert [m.workers for m in config.models] == [[device]]
    if overlay != "cpu":
        assert config.models[0].path.startswith("/data/models/")


def test_service_and_service_monitor_select_the_pods_metrics(rendered):
    _, objs = rendered
    pod_labels = objs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = objs["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert objs["Deployment"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    monitor = objs["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}  # fields of the CRD's Endpoint
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics" and re.fullmatch(r"\d+s", endpoint["interval"])


def matches(selector: str, labels: dict[str, str]) -> bool:
    """Whether a ``k=v,k2=v2`` label selector selects ``labels``."""
    return all(labels.get(k) == v for k, v in (pair.split("=", 1) for pair in selector.split(",")))


def test_gateway_overlay_puts_the_sglang_router_in_front_of_the_scaled_pods():
    docs = render("gateway")
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for (kind, _), obj in named.items():
        if kind != "ServiceMonitor":
            for version in VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
    server, router = named[("Deployment", "xinserve")], named[("Deployment", "sglang-router")]
    # The pods the HPA adds warm up before they join the gateway (the warm path of overlays/cpu).
    assert [c["name"] for c in server["spec"]["template"]["spec"]["initContainers"]] == ["warmup"]
    # The HPA still scales the servers, not the gateway.
    hpa = named[("HorizontalPodAutoscaler", "xinserve")]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "xinserve" and (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 4)
    # The gateway discovers exactly the server pods, on their serving port, in its own namespace.
    (c,) = router["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    value = {flag: args[args.index(flag) + 1] for flag in ("--selector", "--service-discovery-port", "--policy",
                                                             "--service-discovery-namespace")}
    server_labels = server["spec"]["template"]["metadata"]["labels"]
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert "--service-discovery" in args and value["--policy"] == "cache_aware"
    assert matches(value["--selector"], server_labels) and not matches(value["--selector"], router_labels)
    (server_container,) = server["spec"]["template"]["spec"]["containers"]
    assert int(value["--service-discovery-port"]) == server_container["ports"][0]["containerPort"]
    env = {e["name"]: e for e in c["env"]}
    assert value["--service-discovery-namespace"] == "$(POD_NAMESPACE)"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # ... with the right to watch pods there and nothing more, through its own service account.
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    binding = named[("RoleBinding", "sglang-router")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert ("ServiceAccount", account) in named
    (rule,) = named[("Role", binding["roleRef"]["name"])]["rules"]
    assert (rule["resources"], sorted(rule["verbs"])) == (["pods"], ["get", "list", "watch"])
    # Clients reach the gateway; the server Service does not select the gateway's pods.
    gateway_service = named[("Service", "sglang-router")]["spec"]
    assert gateway_service["selector"].items() <= router_labels.items()
    assert not named[("Service", "xinserve")]["spec"]["selector"].items() <= router_labels.items()
    assert gateway_service["ports"][0]["targetPort"] in {p["name"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readiness"


def served_config(args: list[str], config_map: dict[str, Any], tmp_path: Path):
    """The config ``xinserve ARGS`` builds, with the ConfigMap's file where the pod mounts it."""
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    parser = argparse.ArgumentParser()
    _add_serve_args(parser)
    return build_config(parser.parse_args([str(path) if a == "/etc/xinserve/config.yaml" else a for a in args[1:]]))


def test_pods_warm_up_before_they_serve_and_are_ready_only_when_warm(rendered, monkeypatch, tmp_path):
    overlay, objs = rendered
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    (warmup,) = pod["initContainers"]
    assert warmup["image"] == server["image"]
    assert warmup["args"] == ["warmup", "--config", "/etc/xinserve/config.yaml"]
    # Both read one config and one cache volume, mounted where XINSERVE_CACHE_DIR points.
    for c in (warmup, server):
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        env = {e["name"]: e["value"] for e in c["env"]}
        assert mounts["cache"] == env["XINSERVE_CACHE_DIR"] and mounts["config"] == "/etc/xinserve"
        assert [s["secretRef"]["name"] for s in c["envFrom"]] == [objs["Secret"]["metadata"]["name"]]
    assert {m["name"] for m in server["volumeMounts"]} >= {m["name"] for m in warmup["volumeMounts"]}
    if overlay != "cpu":  # a CPU-worker model read from the model volume is warmed up too
        assert {"name": "models", "mountPath": "/data/models", "readOnly": True} in warmup["volumeMounts"]
    # The server the pod runs keeps /health at 503 until every model's warm-up settled ...
    for name, value in objs["Secret"]["stringData"].items():
        monkeypatch.setenv(name, value)
    assert all(m.ready_when_warm for m in served_config(server["args"], objs["ConfigMap"], tmp_path).models)
    # ... and Kubernetes waits long enough for a cold one (no init container, empty caches): 10+ minutes.
    startup = server["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_shared_cache_component_gives_every_replica_one_read_write_many_volume(tmp_path):
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(ROOT / "overlays" / "cpu", overlay)],
        "components": [os.path.relpath(ROOT / "components" / "shared-cache", overlay)]}))
    objs = {d["kind"]: d for d in render(overlay)}
    for kind, obj in objs.items():
        if kind != "ServiceMonitor":
            kubernetes_validate.validate(obj, VERSIONS[-1], strict=True)
    claim = objs["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    volumes = {v["name"]: v for v in objs["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    # The claim replaces the per-pod emptyDir (a volume with both would not validate).
    assert volumes["cache"] == {"name": "cache", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}
