"""Tensor-parallel groups in the config and the flags: how devices form groups, the errors that name
the model, and which ranks each node runs."""

import pytest

from tests.server.test_config import args
from xinserve.server.cli.main import build_config
from xinserve.server.config import ConfigError, parse_config
from xinserve.server.pool.model_pool import ModelPool, group_engine_kwargs, local_cpu_ranks


def model(**kw) -> dict:
    return {"models": [{"name": "glm", "path": "/m", **kw}]}


def test_groups_from_lists_and_from_the_tensor_parallel_size():
    assert parse_config(model(workers=[["npu:0", "npu:1"], ["npu:2", "npu:3"]])).models[0].groups == [
        ["npu:0", "npu:1"], ["npu:2", "npu:3"]]
    assert parse_config(model(workers=["npu:0", "npu:1", "npu:2", "npu:3"], tensor_parallel_size=2)).models[0].groups \
        == [["npu:0", "npu:1"], ["npu:2", "npu:3"]]
    assert parse_config(model(workers=["cpu"], tensor_parallel_size=2)).models[0].groups == [["cpu", "cpu"]]
    assert parse_config(model(workers=["cpu", "cpu"])).models[0].groups == [["cpu"], ["cpu"]]
    flags = build_config(args("--model", "/m", "--device", "cpu", "--tensor-parallel-size", "2"), env={})
    assert flags.models[0].groups == [["cpu", "cpu"]]
    pool = ModelPool(flags.models[0], cpu_threads=1, log_level=20)
    assert [w.label for w in pool.workers] == ["cpu+cpu"] and pool.workers[0].devices == ["cpu", "cpu"]


@pytest.mark.parametrize("workers,tp,message", [
    ([["npu:0", "musa:1"]], 1, "model glm: a tensor-parallel group mixes platforms"),
    ([["npu:0", "npu:0"]], 1, "model glm: device npu:0 is listed twice"),
    ([["npu:0", "npu:1"], ["npu:1", "npu:2"]], 1, "model glm: device npu:1 is listed twice"),
    (["npu:0", "npu:1", "npu:2"], 2, "model glm: 3 worker devices do not form groups"),
    ([["npu:0", "npu:1", "npu:2"]], 2, "model glm: tensor_parallel_size 2 but a group"),
])
def test_bad_groups_are_config_errors_naming_the_model(workers, tp, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(model(workers=workers, tensor_parallel_size=tp))


def test_nodes_split_each_group_and_number_the_rendezvous_ports():
    flags = args("--model", "/m", "--device", "cpu", "--tensor-parallel-size", "4", "--nnodes", "2",
                 "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500")
    config = build_config(flags, env={})
    (group,) = config.models[0].groups
    assert local_cpu_ranks(group, config.distributed) == 2
    kwargs = group_engine_kwargs(group, config.distributed, index=3, cpu_threads=1)
    parallel = kwargs["parallel"]
    assert (kwargs["tensor_parallel_size"], parallel.master_addr, parallel.master_port) == (4, "10.0.0.1", 29503)
    assert list(parallel.node_ranks(1)) == [2, 3]
    with pytest.raises(ConfigError, match="explicit master_port"):
        build_config(args("--model", "/m", "--tensor-parallel-size", "2", "--nnodes", "2"), env={})
    with pytest.raises(ConfigError, match="node_rank 2 is not below nnodes 2"):
        build_config(args("--model", "/m", "--nnodes", "2", "--node-rank", "2", "--master-port", "1"), env={})


def test_every_groups_rendezvous_port_must_exist():
    groups = {"workers": [["npu:0", "npu:1"], ["npu:2", "npu:3"]]}
    with pytest.raises(ConfigError, match="ports 65535..65536, past 65535"):
        parse_config({**model(**groups), "distributed": {"master_port": 65535}})
    assert parse_config({**model(**groups), "distributed": {"master_port": 65534}}).distributed.master_port == 65534


def test_a_replica_of_tp_times_pp_ranks():
    """A pipeline multiplies the ranks of a replica: 8 cards at TP 2 x PP 2 are two replicas of 4,
    each rank's engine told the tensor-parallel size of its stage."""
    from xinserve.server.config import DistributedSettings

    settings = parse_config(model(workers=[f"npu:{i}" for i in range(8)], tensor_parallel_size=2,
                                  pipeline_parallel_size=2)).models[0]
    assert settings.groups == [[f"npu:{i}" for i in range(4)], [f"npu:{i}" for i in range(4, 8)]]
    kwargs = group_engine_kwargs(settings.groups[0], DistributedSettings(), 0, None, pp=2)
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["parallel"].devices == settings.groups[0]
    flags = build_config(args("--model", "/m", "--device", "cpu", "--pipeline-parallel-size", "2"), env={})
    assert flags.models[0].groups == [["cpu", "cpu"]]
    with pytest.raises(ConfigError, match="model glm: 6 worker devices do not form groups of tensor_parallel_size "
                                          "2 x pipeline_parallel_size 2"):
        parse_config(model(workers=[f"npu:{i}" for i in range(6)], tensor_parallel_size=2, pipeline_parallel_size=2))


def test_a_config_file_listing_each_nodes_cards_is_checked_with_the_nnodes_flag(tmp_path):
    """The same file runs on every node (docs/parallelism.md): `npu:0..1` on each of two machines is four
    ranks, valid only once --nnodes 2 applies, so the file is validated after the flags."""
    config_file = tmp_path / "glm.yaml"
    config_file.write_text("models:\n  - name: glm\n    path: /m\n    workers: [npu:0, npu:1, npu:0, npu:1]\n"
                           "    tensor_parallel_size: 4\n")
    with pytest.raises(ConfigError, match="npu:0"):
        build_config(args("--config", str(config_file)), env={})
    flags = args("--config", str(config_file), "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1",
                 "--master-port", "29500")
    config = build_config(flags, env={})
    assert (config.distributed.nnodes, config.models[0].tensor_parallel_size) == (2, 4)
