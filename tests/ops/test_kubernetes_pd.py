"""The disaggregation and multi-node manifests (deploy/kubernetes/disaggregation, overlays/pd-2p1d,
multinode): rendered with ``kubectl kustomize``, every built-in object validated against Kubernetes'
schemas (strict, offline), the LeaderWorkerSet (a CRD) against the LWS API's fields
(tests/fixtures/leaderworkerset-v1.schema.json) with its pod templates against Kubernetes' PodTemplate.
Each container's arguments, with the variables Kubernetes and LWS substitute, go through the server's and
the proxy's own parsers: the role and address each side announces, the node rank each pod runs and the
ranks that gives it. Nothing is applied (no cluster here)."""

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.ops.test_kubernetes import ROOT, VERSIONS
from xinserve.server.cli.main import _add_serve_args, build_config
from xinserve.server.config import AppConfig
from xinserve.server.disagg import proxy
from xinserve.server.pool.model_pool import group_engine_kwargs

LWS_SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "leaderworkerset-v1.schema.json").read_text())


def render(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is missing (it renders the Kustomize overlays)"
    proc = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(proc.stdout) if d}


def substitute(args: list[str], env: dict[str, str]) -> list[str]:
    """``args`` with Kubernetes' $(VAR) references replaced from ``env`` (an unknown one is an error here)."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def served_config(objs: dict, container: dict[str, Any], env: dict[str, str], monkeypatch) -> AppConfig:
    """The config ``xinserve serve`` with the container's arguments runs, its ConfigMap and Secret mounted."""
    argv = substitute(container["args"], env)
    assert argv[:3] == ["serve", "--config", "/etc/xinserve/config.yaml"]
    (secret,) = [o for (kind, _), o in objs.items() if kind == "Secret"]
    assert [s["secretRef"]["name"] for s in container["envFrom"]] == [secret["metadata"]["name"]]
    for name, value in secret["stringData"].items():
        monkeypatch.setenv(name, value)
    (config_map,) = [o for (kind, _), o in objs.items() if kind == "ConfigMap"]
    path = Path(monkeypatch.tmp_path) / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    parser = argparse.ArgumentParser()
    _add_serve_args(parser)
    return build_config(parser.parse_args([*argv[1:2], str(path), *argv[3:]]), env={})


@pytest.fixture
def tmp_monkeypatch(monkeypatch, tmp_path):
    monkeypatch.tmp_path = tmp_path
    return monkeypatch


def validate_builtins(objs: dict) -> None:
    for (kind, _), obj in objs.items():
        if kind != "LeaderWorkerSet":
            for version in VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)


def pod_spec(objs: dict, deployment: str) -> dict[str, Any]:
    return objs[("Deployment", deployment)]["spec"]["template"]["spec"]


def config_volume(spec: dict[str, Any]) -> str:
    (volume,) = [v for v in spec["volumes"] if "configMap" in v]
    return volume["configMap"]["name"]


@pytest.mark.parametrize(("where", "prefills"), [("disaggregation", 1), ("overlays/pd-2p1d", 2)])
def test_pd_manifests_run_both_sides_behind_the_proxy(where, prefills, tmp_monkeypatch):
    objs = render(ROOT / where)
    validate_builtins(objs)
    assert {k for k in objs if k[0] in ("Deployment", "Service")} == {
        (kind, name) for kind in ("Deployment", "Service") for name in ("xinserve-prefill", "xinserve-decode")
    } | {("Deployment", "xinserve-pd-proxy"), ("Service", "xinserve-pd")}
    assert objs[("Deployment", "xinserve-prefill")]["spec"]["replicas"] == prefills
    assert objs[("Deployment", "xinserve-decode")]["spec"]["replicas"] == 1
    (config_map,) = [name for kind, name in objs if kind == "ConfigMap"]
    labels = {}
    for side, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        spec = pod_spec(objs, f"xinserve-{side}")
        (c,) = spec["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        (model,) = served_config(objs, c, {"POD_IP": "10.0.0.9"}, tmp_monkeypatch).models
        transfer = model.kv_transfer_config
        assert (transfer["kv_connector"], transfer["kv_role"], transfer["kv_ip"]) == ("MooncakeConnector", role, "10.0.0.9")
        assert transfer["kv_port"] in {p["containerPort"] for p in c["ports"]}
        assert c["image"] == "xinserve:cpu-pd" and config_volume(spec) == config_map
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        labels[side] = objs[("Deployment", f"xinserve-{side}")]["spec"]["template"]["metadata"]["labels"]
    labels["proxy"] = objs[("Deployment", "xinserve-pd-proxy")]["spec"]["template"]["metadata"]["labels"]

    # The proxy's legs are the two Services, each selecting its side's pods and no other.
    (c,) = pod_spec(objs, "xinserve-pd-proxy")["containers"]
    assert c["command"] == ["python", "-m", "xinserve.server.disagg.proxy"]
    seen = {}
    tmp_monkeypatch.setattr(proxy, "make_app", lambda prefill, decode: seen.update(prefill=prefill, decode=decode))
    tmp_monkeypatch.setattr(proxy.uvicorn, "run", lambda app, host, port, **_: seen.update(host=host, port=port))
    proxy.main(c["args"])
    for side in ("prefill", "decode"):
        (url,) = seen[side]
        host, port = url.removeprefix("http://").split(":")
        service = objs[("Service", host)]["spec"]
        assert int(port) == service["ports"][0]["port"]
        for other, pod_labels in labels.items():
            assert (service["selector"].items() <= pod_labels.items()) == (other == side), (host, other)
    front = objs[("Service", "xinserve-pd")]["spec"]
    assert front["selector"].items() <= labels["proxy"].items()
    assert seen["port"] == c["ports"][0]["containerPort"] and seen["host"] == "0.0.0.0"


@pytest.fixture(scope="module")
def multinode() -> dict:
    return render(ROOT / "multinode")


def lws_templates(lws: dict[str, Any]) -> dict[str, dict[str, Any]]:
    template = lws["spec"]["leaderWorkerTemplate"]
    return {"leader": template["leaderTemplate"], "worker": template["workerTemplate"]}


def test_the_leader_worker_set_validates_against_the_lws_api_and_its_pods_against_kubernetes(multinode):
    validate_builtins(multinode)
    lws = multinode[("LeaderWorkerSet", "xinserve-multinode")]
    jsonschema.validate(lws, LWS_SCHEMA)
    for role, template in lws_templates(lws).items():
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role}, "template": template}
        for version in VERSIONS:
            kubernetes_validate.validate(pod_template, version, strict=True)
    # The schema is a real check: a misspelt field and a value outside an enum fail it.
    for path, value in ((("leaderWorkerTemplate", "sizee"), 2), (("leaderWorkerTemplate", "restartPolicy"), "Always")):
        broken = json.loads(json.dumps(lws))
        broken["spec"][path[0]][path[1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, LWS_SCHEMA)


@pytest.mark.parametrize("worker_index", [0, 1])
def test_each_pod_runs_its_node_rank_of_the_group(multinode, worker_index, tmp_monkeypatch):
    lws = multinode[("LeaderWorkerSet", "xinserve-multinode")]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    template = lws_templates(lws)["leader" if worker_index == 0 else "worker"]
    (c,) = template["spec"]["containers"]
    # What the LWS controller sets in every container of group 0.
    env = {"LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(worker_index),
           "LWS_LEADER_ADDRESS": "xinserve-multinode-0.xinserve-multinode.default"}
    config = served_config(multinode, c, env, tmp_monkeypatch)
    dist = config.distributed
    assert (dist.nnodes, dist.node_rank, dist.master_addr) == (size, worker_index, env["LWS_LEADER_ADDRESS"])
    assert dist.master_port > 0
    file_distributed = yaml.safe_load(multinode[next(k for k in multinode if k[0] == "ConfigMap")]["data"]["config.yaml"])
    assert file_distributed["distributed"]["nnodes"] == size  # validated before --nnodes applies
    (model,) = config.models
    (group,) = model.groups
    kwargs = group_engine_kwargs(group, dist, 0, None, model.pipeline_parallel_size)
    ranks = list(kwargs["parallel"].node_ranks(worker_index))
    per_node = len(group) // size
    assert ranks == list(range(worker_index * per_node, (worker_index + 1) * per_node))
    # One pipeline stage per machine: this node's ranks are exactly one stage's (stage * tp + tp_rank).
    assert model.tensor_parallel_size == per_node and model.pipeline_parallel_size == size
    # The pod asks for as many NPUs as its ranks use, and mounts the config and the model.
    resources = c["resources"]
    assert resources["limits"]["huawei.com/Ascend910"] == resources["requests"]["huawei.com/Ascend910"] == per_node
    assert {d.split(":")[1] for d in group[ranks[0]:ranks[-1] + 1]} == {str(i) for i in range(per_node)}
    (config_map,) = [name for kind, name in multinode if kind == "ConfigMap"]
    assert config_volume(template["spec"]) == config_map  # the hashed name reached the CRD (kustomizeconfig.yaml)
    claims = [v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["xinserve-models"] and ("PersistentVolumeClaim", "xinserve-models") in multinode
    # Only node 0 serves HTTP: only the leader has the port and the probes.
    serves = worker_index == 0
    assert ("readinessProbe" in c, "ports" in c) == (serves, serves)
    if serves:
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_the_service_reaches_the_leaders_only(multinode):
    lws = multinode[("LeaderWorkerSet", "xinserve-multinode")]
    selector = multinode[("Service", "xinserve-multinode")]["spec"]["selector"]
    # The label LWS adds to every pod of the set (leaderworkerset.sigs.k8s.io/name), and the templates' own.
    lws_label = {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"]}
    for role, template in lws_templates(lws).items():
        labels = {**template["metadata"]["labels"], **lws_label}
        assert (selector.items() <= labels.items()) == (role == "leader"), role
