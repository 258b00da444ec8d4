"""``xinserve doctor``: which devices this machine offers, their memory, and why one is missing.

Each probe imports only what its device needs (torch_npu for Ascend, torch_musa for Moore Threads)
and turns every failure into a one-line reason instead of a traceback. What to install for each device
is its platform module's (engines/platforms/), as a worker that fails to start says it.
"""

import argparse
import importlib
import json
import os
import platform
from collections.abc import Mapping
from importlib import metadata
from types import ModuleType
from typing import Any

from xinserve.engines.platforms import ACCELERATORS

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


def _accelerator(vendor: ModuleType) -> dict[str, Any]:
    """Probe ``torch.<kind>`` for the platform module ``vendor`` (engines/platforms/) after importing its
    extension module (if it has one); a reason names what to install, in the platform's words."""
    try:
        import torch
    except ImportError:
        return {"available": False, "reason": "torch is not installed"}
    kind, module_name, install_hint = vendor.KIND, vendor.VENDOR_MODULE, f"install {vendor.INSTALL_HINT}"
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
    build_problem = getattr(vendor, "torch_build_problem", lambda: None)()
    if build_problem is not None:
        return {"available": False, "reason": build_problem}
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


# A typical served model's shapes (Qwen2.5-7B: GQA 7:1, head dim 128) for the kernel probes, served with
# adapters (--enable-lora at rank 16, 4 slots) so that the multi-LoRA candidates are probed and reported too.
TYPICAL_SHAPES = {"num_heads": 28, "num_kv_heads": 4, "head_dim": 128, "rotary_dim": 128, "rope_is_neox": True,
                  "hidden_size": 3584, "intermediate_size": 18944, "vocab_size": 152064, "max_lora_rank": 16,
                  "max_loras": 4}


def probe_kernels(device: str) -> dict[str, Any]:
    """The kernel registry's choice on ``device`` for a typical model, in its usual dtype, with the
    rejected candidates and why (what a worker would log at start-up)."""
    try:
        from xinserve.engines.platforms import get_platform  # opens the device: imports torch
        from xinserve.kernels.model_shapes import ModelShapes
        from xinserve.kernels.registry import select

        platform = get_platform(device)
        dtype = platform.typical_dtype
        shapes = ModelShapes(**TYPICAL_SHAPES, block_size=platform.default_block_size)
        selection = select(platform.kernel_preference, platform.device, dtype, shapes)
    except Exception as exc:  # noqa: BLE001  a broken device or driver is a finding, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"dtype": str(dtype).removeprefix("torch."), "ops": selection.report()}


def _module_version(name: str, distributions: Mapping[str, list[str]]) -> str | None:
    """The installed version of module ``name`` (None: not installed), from its distribution's metadata
    (``distributions``: importlib.metadata.packages_distributions()), not by importing it. Imported,
    triton loads its nanobind extension, whose objects are still alive when the CLI freezes the heap
    and leaves (engines/worker/process_exit.py): nanobind then prints ~30 lines of "leaked" on stderr at exit.
    A module installed without metadata (a vendor build copied in by hand) is imported, as before."""
    for distribution in distributions.get(name, ()):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    try:
        return str(getattr(importlib.import_module(name), "__version__", "?"))
    except Exception:  # noqa: BLE001  a vendor module without its driver fails in many ways
        return None


def _cann_version() -> str | None:
    """The CANN toolkit version from its install's version file (set_env.sh exports its home)."""
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or "/usr/local/Ascend/ascend-toolkit/latest"
    for name in ("version.cfg", "version.info"):
        try:
            with open(os.path.join(home, name)) as f:
                for line in f:
                    if "version" in line.lower() and "=" in line:
                        return line.split("=", 1)[1].strip()
        except OSError:
            continue
    return None


def versions() -> dict[str, str | None]:
    """The software stack of every platform (None: not installed)."""
    installed = metadata.packages_distributions()
    found: dict[str, str | None] = {"torch": _module_version("torch", installed),
                                    "triton": _module_version("triton", installed)}
    try:
        import torch

        found["cuda"] = torch.version.cuda
        found["musa"] = getattr(torch.version, "musa", None)
    except ImportError:
        pass
    found["torch_npu"] = _module_version("torch_npu", installed)
    found["cann"] = _cann_version()
    found["torch_musa"] = _module_version("torch_musa", installed)
    found["mate"] = _module_version("mate", installed)
    return found


def collect() -> dict[str, Any]:
    report = {"cpu": probe_cpu()} | {kind: _accelerator(vendor) for kind, vendor in ACCELERATORS.items()}
    devices = {"cpu": "cpu"} | {kind: report[kind]["devices"][0]["device"] for kind in ACCELERATORS
                                if report[kind]["available"]}
    report["versions"] = versions()
    report["kernels"] = {kind: probe_kernels(device) for kind, device in devices.items()}
    return report


def _print_kernels(kernels: dict[str, Any]) -> None:
    for kind, found in kernels.items():
        if "error" in found:
            print(f"kernels on {kind}: probe failed: {found['error']}")
            continue
        print(f"kernels on {kind} ({found['dtype']}):")
        for op, entry in found["ops"].items():
            notes = []
            if "timings_ms" in entry:
                notes.append("timed " + ", ".join(f"{i} {ms:.3g} ms" for i, ms in entry["timings_ms"].items()))
            if entry["rejected"]:
                notes.append("rejected " + "; ".join(f"{r['impl']}: {r['reason']}" for r in entry["rejected"]))
            print(f"  {op:<18} {entry['chosen']:<10} {' | '.join(notes)}".rstrip())


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    cpu = report["cpu"]
    print(f"cpu   : {cpu.get('cores_usable')} usable cores ({cpu.get('machine')}), "
          f"{cpu.get('memory_available_gib')} / {cpu.get('memory_total_gib')} GiB free, "
          f"avx512={cpu.get('avx512')} amx_bf16={cpu.get('amx_bf16')}, torch {cpu.get('torch', '-')}")
    for kind in ACCELERATORS:
        found = report[kind]
        if not found["available"]:
            print(f"{kind:<6}: not available: {found['reason']}")
            continue
        for d in found["devices"]:
            memory = f"{d.get('memory_free_gib')} / {d.get('memory_total_gib')} GiB free"
            print(f"{kind:<6}: {d['device']} {d.get('name', '?')}, {d.get('error', memory)}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v is not None))
    usable = ["cpu"] + [d["device"] for k in ACCELERATORS if report[k]["available"]
                        for d in report[k]["devices"]]
    print(f"workers you can configure: {', '.join(usable)}")
    _print_kernels(report["kernels"])
    return 0
