"""``xinserve doctor``: which devices this machine offers, their memory, and why one is missing.

Each probe imports only what its device needs (torch_npu for Ascend, torch_musa for Moore Threads)
and turns every failure into a one-line reason instead of a traceback.
"""

import argparse
import importlib
import json
import os
import platform
from typing import Any

GIB = 1024**3


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the findings as JSON")


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def probe_cpu() -> dict[str, Any]:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    mem = _meminfo()
    flags = _cpu_flags()
    info: dict[str, Any] = {
        "available": True,
        "machine": platform.machine(),
        "cores_usable": cores,
        "memory_total_gib": round(mem.get("MemTotal", 0) / GIB, 1),
        "memory_available_gib": round(mem.get("MemAvailable", 0) / GIB, 1),
        "avx512": "avx512f" in flags,
        # AMX makes bfloat16 matmuls fast on CPU (DESIGN.md: bf16 where the CPU has AMX).
        "amx_bf16": "amx_bf16" in flags,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError as exc:
        info["available"] = False
        info["reason"] = f"torch is not installed ({exc})"
    return info


def _accelerator(kind: str, module_name: str | None, install_hint: str) -> dict[str, Any]:
    """Probe ``torch.<kind>`` after importing its extension module (if it has one)."""
    try:
        import torch
    except ImportError:
        return {"available": False, "reason": "torch is not installed"}
    if module_name is not None:
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            return {"available": False, "reason": f"{module_name} is not installed ({exc}); {install_hint}"}
        except Exception as exc:  # noqa: BLE001  vendor extensions fail in many ways without their driver
            return {"available": False, "reason": f"importing {module_name} failed: {type(exc).__name__}: {exc}"}
    backend = getattr(torch, kind, None)
    if backend is None:
        return {"available": False, "reason": f"torch has no '{kind}' backend; {install_hint}"}
    if kind == "cuda" and torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return {"available": False, "reason": f"this torch ({torch.__version__}) is a CPU-only build"}
    try:
        count = backend.device_count() if backend.is_available() else 0
    except Exception as exc:  # noqa: BLE001  a driver error is a finding, not a crash
        return {"available": False, "reason": f"torch.{kind} failed: {type(exc).__name__}: {exc}"}
    if count == 0:
        return {"available": False, "reason": f"torch.{kind} sees no device (driver missing, or none visible)"}
    devices = []
    for i in range(count):
        entry: dict[str, Any] = {"index": i, "device": f"{kind}:{i}"}
        try:
            entry["name"] = backend.get_device_name(i)
            free, total = backend.mem_get_info(i)
            entry["memory_free_gib"] = round(free / GIB, 1)
            entry["memory_total_gib"] = round(total / GIB, 1)
        except Exception as exc:  # noqa: BLE001  report what could be read
            entry["error"] = f"{type(exc).__name__}: {exc}"
        devices.append(entry)
    return {"available": True, "devices": devices}


def probe_kernels() -> dict[str, str]:
    """Which implementation each kernel name is bound to right now (the registry may rebind them)."""
    try:
        kernels = importlib.import_module("kernels")
    except ImportError as exc:
        return {"error": str(exc)}
    return {name: getattr(getattr(kernels, name), "__module__", "?") for name in getattr(kernels, "__all__", [])}


def collect() -> dict[str, Any]:
    return {
        "cpu": probe_cpu(),
        "cuda": _accelerator("cuda", None, "install a CUDA build of torch"),
        "npu": _accelerator("npu", "torch_npu", "pip install torch-npu (needs Ascend's CANN toolkit)"),
        "musa": _accelerator("musa", "torch_musa", "use Moore Threads' MUSA image (torch_musa is not on PyPI)"),
        "kernels": probe_kernels(),
    }


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    cpu = report["cpu"]
    print(f"cpu   : {cpu.get('cores_usable')} usable cores ({cpu.get('machine')}), "
          f"{cpu.get('memory_available_gib')} / {cpu.get('memory_total_gib')} GiB free, "
          f"avx512={cpu.get('avx512')} amx_bf16={cpu.get('amx_bf16')}, torch {cpu.get('torch', '-')}")
    for kind in ("cuda", "npu", "musa"):
        found = report[kind]
        if not found["available"]:
            print(f"{kind:<6}: not available: {found['reason']}")
            continue
        for d in found["devices"]:
            memory = f"{d.get('memory_free_gib')} / {d.get('memory_total_gib')} GiB free"
            print(f"{kind:<6}: {d['device']} {d.get('name', '?')}, {d.get('error', memory)}")
    usable = ["cpu"] + [d["device"] for k in ("cuda", "npu", "musa") if report[k]["available"]
                        for d in report[k]["devices"]]
    print(f"workers you can configure: {', '.join(usable)}")
    print("kernels: " + ", ".join(f"{k}={v}" for k, v in report["kernels"].items()))
    return 0
