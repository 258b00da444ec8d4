"""``xinserve doctor`` on this machine: the CPU is found, absent accelerators come with a reason."""

import argparse
import json

from xinserve.server.cli import doctor


def test_report_names_what_is_missing_and_why():
    report = doctor.collect()
    assert report["cpu"]["available"] and report["cpu"]["cores_usable"] >= 1
    assert report["cpu"]["memory_total_gib"] > 0
    for kind, module in (("npu", "torch_npu"), ("musa", "torch_musa")):
        if not report[kind]["available"]:
            assert module in report[kind]["reason"]
    if not report["cuda"]["available"]:
        assert report["cuda"]["reason"]
    cpu_kernels = report["kernels"]["cpu"]
    assert cpu_kernels["dtype"] == "float32"
    decode = cpu_kernels["ops"]["decode_attention"]
    assert set(decode["timings_ms"]) == {"cpp", "reference"}  # chosen by speed
    assert decode["chosen"] == min(decode["timings_ms"], key=decode["timings_ms"].get)
    # no CPU candidate implements multi-LoRA's ops: the reference serves them, and the report says so
    assert cpu_kernels["ops"]["lora"] == {"chosen": "reference", "rejected": []}


def test_cli_output(capsys):
    assert doctor.run(argparse.Namespace(json=False)) == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu   :") and "workers you can configure: cpu" in out
    assert "kernels on cpu (float32):" in out and "decode_attention" in out and "versions: torch 2." in out
    assert doctor.run(argparse.Namespace(json=True)) == 0
    found = json.loads(capsys.readouterr().out)
    assert set(found) == {"cpu", "cuda", "npu", "musa", "versions", "kernels"}
    assert found["versions"]["torch"].startswith("2.") and {"torch_npu", "cann", "torch_musa"} <= set(found["versions"])
