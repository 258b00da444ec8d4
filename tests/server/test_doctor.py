"""``xinserve doctor`` on this machine: the CPU is found, absent accelerators come with a reason."""

import argparse
import json

from server import doctor


def test_report_names_what_is_missing_and_why():
    report = doctor.collect()
    assert report["cpu"]["available"] and report["cpu"]["cores_usable"] >= 1
    assert report["cpu"]["memory_total_gib"] > 0
    for kind, module in (("npu", "torch_npu"), ("musa", "torch_musa")):
        if not report[kind]["available"]:
            assert module in report[kind]["reason"]
    if not report["cuda"]["available"]:
        assert report["cuda"]["reason"]
    assert "write_kv" in report["kernels"]


def test_cli_output(capsys):
    assert doctor.run(argparse.Namespace(json=False)) == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu   :") and "workers you can configure: cpu" in out
    assert doctor.run(argparse.Namespace(json=True)) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"cpu", "cuda", "npu", "musa", "kernels"}
