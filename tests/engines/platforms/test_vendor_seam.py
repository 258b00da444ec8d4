"""The vendor seam: every device kind is known in its own module under engines/platforms/, and no other
file of server/ or engines/ branches on a device kind's name."""

import ast
from pathlib import Path

import pytest
import torch

from xinserve.engines.platforms import ACCELERATORS, KINDS
from xinserve.kernels import ep_dispatch, registry

ROOT = Path(__file__).resolve().parents[3]
PLATFORMS = ROOT / "engines" / "platforms"
CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", KINDS)
def test_every_kernel_preference_names_registry_modules_and_ends_with_the_reference(kind):
    preference = KINDS[kind].KERNEL_PREFERENCE
    assert set(preference) <= set(registry.MODULES) and preference[-1] == "reference"
    registry.check_preference(preference)  # what select() checks first


@pytest.mark.parametrize("kind", KINDS)
def test_every_ep_dispatch_preference_names_exchanges_and_ends_with_all_to_all(kind):
    preference = KINDS[kind].EP_DISPATCH_PREFERENCE
    assert set(preference[:-1]) <= set(ep_dispatch.MODULES) and preference[-1] == ep_dispatch.REFERENCE


@pytest.mark.parametrize("kind", KINDS)
def test_the_record_carries_its_modules_lists_and_flags(kind):
    module = KINDS[kind]
    platform = module.record(CPU)  # building a record touches no card
    assert platform.kind == kind == module.KIND
    assert platform.kernel_preference == module.KERNEL_PREFERENCE
    assert platform.ep_dispatch_preference == module.EP_DISPATCH_PREFERENCE
    assert platform.splits_host_threads == module.SPLITS_HOST_THREADS


def test_each_kind_keeps_its_defaults_backend_and_graph_class():
    records = {kind: module.record(CPU) for kind, module in KINDS.items()}
    assert {k: p.default_block_size for k, p in records.items()} == {"cpu": 16, "cuda": 16, "npu": 128, "musa": 64}
    assert {k: p.dist_backend for k, p in records.items()} == {"cpu": "gloo", "cuda": "nccl", "npu": "hccl",
                                                                "musa": "mccl"}
    assert {k: p.graph_class for k, p in records.items()} == {"cpu": None, "cuda": "CUDAGraph", "npu": "NPUGraph",
                                                               "musa": "MUSAGraph"}
    assert {k: p.kernel_preference for k, p in records.items()} == {
        "cpu": ("cpp", "sdpa", "int8mm", "dequant", "reference"),
        "cuda": ("triton", "grouped_mm", "int8mm", "dequant", "reference"),
        "npu": ("npu", "npu_kv", "dequant", "reference"),
        "musa": ("musa", "triton", "dequant", "reference"),
    }
    assert records["npu"].ep_dispatch_preference == ("npu_moe_dispatch", "all_to_all")


def test_only_the_cpu_runs_on_the_host():
    """The capability flags that replaced ``kind == "cpu"``: on the CPU the decode buckets are compiled,
    C++ kernels build in the background, ranks split the host's threads, steps are scheduled ahead and
    the host tier is not pinned; every accelerator is the other way round."""
    cpu = KINDS["cpu"].record(CPU)
    assert not cpu.captures_graphs and cpu.builds_kernels_in_background and cpu.splits_host_threads
    assert cpu.schedules_ahead and not cpu.pins_host_memory and cpu.typical_dtype == torch.float32
    assert cpu.default_kv_cache_memory_fraction == 0.1
    for module in ACCELERATORS.values():
        card = module.record(CPU)
        assert card.captures_graphs and card.pins_host_memory and card.typical_dtype == torch.bfloat16
        assert not (card.builds_kernels_in_background or card.splits_host_threads or card.schedules_ahead)
        assert card.default_kv_cache_memory_fraction == 0.7 and not module.RANKS_SHARE_THE_DEVICE


def _device_kind_literals(node: ast.expr) -> list[str]:
    """The device kind names a comparison operand spells out: "cpu", or ("cpu", "npu"), or ["cpu"]."""
    if isinstance(node, ast.Constant) and node.value in KINDS:
        return [node.value]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [name for element in node.elts for name in _device_kind_literals(element)]
    return []


def _kind_comparisons(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [f"{where}:{node.lineno} compares with {name!r}" for name in _device_kind_literals(operand)]
    return found


def test_no_file_outside_the_platforms_compares_a_device_kind_with_a_literal():
    """``platform.kind == "cpu"``, ``device.type != "cpu"``, ``group[0] == "cpu"``: each is a platform's flag."""
    files = [p for package in ("server", "engines") for p in (ROOT / package).rglob("*.py")
             if PLATFORMS not in p.parents]
    assert len(files) > 100
    hits = [hit for path in files for hit in _kind_comparisons(path.read_text(), str(path.relative_to(ROOT)))]
    assert hits == []


def test_the_scan_finds_kind_comparisons_and_leaves_devices_alone():
    source = 'if platform.kind != "cpu" or device.type in ("npu", "musa") or plain == ["cuda:0"]:\n    pass\n'
    assert _kind_comparisons(source, "sample.py") == [f"sample.py:1 compares with {name!r}"
                                                      for name in ("cpu", "npu", "musa")]
