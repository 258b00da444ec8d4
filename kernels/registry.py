"""Which implementation of each op a worker uses: among its platform's candidates (the preference
list its platform module in engines/platforms/ owns, passed in by the runner) that import,
accept the model's shapes, run on the device and agree with the reference, the fastest at the
model's shapes where the op is timed (kernels/probes/timing.py), else the first in preference order.

A fused vendor operator can be missing or broken on a given chip or driver version; then the
next candidate is taken and the reason is kept (``not installed: ...``, ``raised AclError: ...``,
``max abs err 3e-01 > 3e-02``, ``head_dim 8 unsupported``), for the start-up log, ``/health`` and
``xinserve doctor``. The pure-torch reference closes every list and is never probed (it is what
the others are compared with).

``XINSERVE_KERNELS="op=impl,..."`` and a model's ``kernels:`` config force a choice; a forced
choice that cannot be used fails start-up with its reason.

A candidate built from source on first use (``BUILT_FROM_SOURCE``: the C++ kernels) can take minutes
to build. With ``defer_builds`` a selection does not wait for a build that is not on disk yet: the
candidate is reported as building (``KernelSelection.deferred``), the next one serves, and the
caller builds it and selects again later (engines/worker/warmup.py, in a background thread).
"""

import importlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch

from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.ops import OP_FUNCTIONS, OPS, KernelOps
from xinserve.kernels.probes.checks import applies, probe, probe_tolerance
from xinserve.kernels.probes.timing import WORKLOADS, TimingCache, fastest, measure

# implementation name -> module exposing ``OPS`` (and optionally ``unsupported(op, shapes, dtype)``, and
# ``serves(op, shapes, dtype)``: False where it is no candidate at all, so nothing is reported)
MODULES = {
    "reference": "xinserve.kernels.references.dense",
    "cpp": "xinserve.kernels.cpu.cpp",
    "sdpa": "xinserve.kernels.cpu.sdpa_prefill",
    "triton": "xinserve.kernels.triton",
    "grouped_mm": "xinserve.kernels.cuda.grouped_mm",
    "npu": "xinserve.kernels.ascend.ops",
    "npu_kv": "xinserve.kernels.ascend.kv",
    "musa": "xinserve.kernels.musa.ops",
    "int8mm": "xinserve.kernels.quant_int8",
    "dequant": "xinserve.kernels.quant_dequant",
}
# implementation name -> module that builds it: ``built()`` (on disk already?), ``build()``, and
# ``BUILDS_OPS``, the ops it provides once built
BUILT_FROM_SOURCE = {"cpp": "xinserve.kernels.cpu.cpp_build"}
ENV_VAR = "XINSERVE_KERNELS"
# "off": choose by preference order without timing (fake devices in tests, or a start-up in a hurry)
TIMING_ENV_VAR = "XINSERVE_KERNEL_TIMING"


def timing_enabled() -> bool:
    return os.environ.get(TIMING_ENV_VAR, "on").lower() not in ("0", "off", "false", "no")


class KernelSelectionError(ValueError):
    """A forced kernel choice that cannot be used here, or a malformed forcing."""


@dataclass(slots=True)
class KernelSelection:
    chosen: dict[str, str]  # op -> implementation name
    rejected: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # op -> [(impl, reason)]
    # op -> {impl: milliseconds} for ops where several candidates were correct and timed
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    ops: KernelOps | None = None  # the chosen functions, for the model and the sampler
    # Graph capture (kernels/ops.py): op -> implementation, for the ops the model calls whose chosen
    # functions cannot be captured; and the chosen functions' capture hooks.
    uncapturable: dict[str, str] = field(default_factory=dict)
    capture_hooks: list[Callable] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)  # implementations not built yet (``defer_builds``)

    def report(self) -> dict[str, dict]:
        """Per op: the chosen implementation, the rejected ones with their reasons, and the timings
        when the choice was made by speed (JSON-ready)."""
        out = {}
        for op, name in self.chosen.items():
            entry = {"chosen": name, "rejected": [{"impl": i, "reason": r} for i, r in self.rejected.get(op, [])]}
            if op in self.timings_ms:
                entry["timings_ms"] = self.timings_ms[op]
            out[op] = entry
        return out

    def table(self) -> str:
        """A few log lines: one per op."""
        lines = []
        for op, name in self.chosen.items():
            notes = []
            if op in self.timings_ms:
                notes.append("timed " + ", ".join(f"{i} {ms:.3g} ms" for i, ms in self.timings_ms[op].items()))
            if op in self.uncapturable:
                notes.append("not graph-capturable")
            if op in self.rejected:
                notes.append("rejected " + "; ".join(f"{i}: {r}" for i, r in self.rejected[op]))
            lines.append(f"  {op:<18} {name:<10} {' | '.join(notes)}".rstrip())
        return "\n".join(lines)


def parse_forced(text: str | None) -> dict[str, str]:
    """``"op=impl,op=impl"`` -> {op: impl}; unknown ops or implementations are an error."""
    forced: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        op, sep, impl = (part.strip() for part in item.partition("="))
        if not sep or op not in OP_FUNCTIONS or impl not in MODULES:
            raise KernelSelectionError(
                f"bad kernel choice {item.strip()!r}: expected op=impl with op in {', '.join(OPS)} "
                f"and impl in {', '.join(MODULES)}"
            )
        forced[op] = impl
    return forced


def select(
    preference: Sequence[str],
    device: torch.device,
    dtype: torch.dtype,
    shapes: ModelShapes,
    forced: dict[str, str] | None = None,
    defer_builds: bool = False,
    time_candidates: bool = True,
) -> KernelSelection:
    """Probe the candidates in ``preference`` (names in MODULES, most preferred first, "reference"
    last: a platform's ``kernel_preference``) for every op and return the selection.

    ``forced`` (a model's ``kernels:`` config) wins over ``XINSERVE_KERNELS``, which wins over the
    platform's preference. Raises KernelSelectionError when a forced choice cannot be used.
    ``defer_builds``: skip unforced candidates that are not built yet (see the module's docstring).
    ``time_candidates`` False: the preference order decides, as with ``XINSERVE_KERNEL_TIMING=off``.
    """
    check_preference(preference)
    forced = {**parse_forced(os.environ.get(ENV_VAR)), **(forced or {})}
    selection = KernelSelection(chosen={})
    functions: dict[str, Callable] = {}
    timings = TimingCache()
    for op in OPS:
        names = (forced[op],) if op in forced else tuple(preference)
        correct: dict[str, dict[str, Callable]] = {}
        reason = None
        for name in names:
            if defer_builds and op not in forced and _unbuilt(name):  # importing it would build it
                if _builds(name, op, shapes):
                    if name not in selection.deferred:
                        selection.deferred.append(name)
                    selection.rejected.setdefault(op, []).append((name, "not built yet: building in the background"))
                continue
            candidate, reason = _try(op, name, shapes, device, dtype)
            if candidate is not None:
                correct[name] = candidate
            elif reason is not None:
                selection.rejected.setdefault(op, []).append((name, reason))
        if not correct:
            if op in forced:
                raise KernelSelectionError(f"kernel {op}={forced[op]} was forced but cannot be used on "
                                           f"{device} in {dtype}: {reason}")
            raise KernelSelectionError(f"no implementation of {op} on {device}")  # reference is last
        name = next(iter(correct))
        if len(correct) > 1 and op in WORKLOADS and time_candidates and timing_enabled():
            measured = {n: _timed(timings, op, n, f, shapes, device, dtype) for n, f in correct.items()}
            selection.timings_ms[op] = {n: round(seconds * 1000, 4) for n, seconds in measured.items()}
            name = fastest(measured, names)
        selection.chosen[op] = name
        functions.update(correct[name])
        if applies(op, shapes):
            _note_capture(selection, op, name, correct[name].values())
    selection.ops = KernelOps.from_functions(functions)
    return selection


def check_preference(preference: Sequence[str]) -> None:
    """A preference list names implementations in MODULES and ends with the reference (which always serves)."""
    unknown = [name for name in preference if name not in MODULES]
    if unknown or not preference or preference[-1] != "reference":
        raise KernelSelectionError(f"bad kernel preference {tuple(preference)}: expected names in "
                                   f"{', '.join(MODULES)}, ending with reference")


def _unbuilt(name: str) -> bool:
    """Whether ``name`` is built from source and not built yet."""
    return name in BUILT_FROM_SOURCE and not importlib.import_module(BUILT_FROM_SOURCE[name]).built()


def _builds(name: str, op: str, shapes: ModelShapes) -> bool:
    """Whether ``name`` (built from source) will provide ``op``, and this model calls it."""
    return applies(op, shapes) and op in importlib.import_module(BUILT_FROM_SOURCE[name]).BUILDS_OPS


def _note_capture(selection: KernelSelection, op: str, name: str, chosen: Iterable[Callable]) -> None:
    for function in chosen:
        if not getattr(function, "graph_capturable", True):
            selection.uncapturable[op] = name
        hook = getattr(function, "graph_capture_hook", None)
        if hook is not None and hook not in selection.capture_hooks:
            selection.capture_hooks.append(hook)


def _timed(cache: TimingCache, op: str, name: str, functions: dict[str, Callable], shapes: ModelShapes,
           device: torch.device, dtype: torch.dtype) -> float:
    key = cache.key(op, name, functions, shapes, device, dtype)
    seconds = cache.get(key)
    if seconds is None:
        seconds = measure(op, functions, shapes, device, dtype)
        cache.put(key, seconds)
    return seconds


def _try(
    op: str, name: str, shapes: ModelShapes, device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, Callable] | None, str | None]:
    """(the op's functions, None) when usable; (None, reason) when not; (None, None) when the
    implementation does not provide the op at all, or the model never calls it (not a candidate,
    nothing to report: a dense model keeps the reference fused_moe unprobed)."""
    if name != "reference" and not applies(op, shapes):
        return None, None
    try:
        module = importlib.import_module(MODULES[name])
    except ImportError as exc:
        return None, f"not installed ({exc})"
    available = getattr(module, "OPS", {})
    if not all(f in available for f in OP_FUNCTIONS[op]):
        return None, None
    if not getattr(module, "serves", lambda *_: True)(op, shapes, dtype):
        return None, None
    functions = {f: available[f] for f in OP_FUNCTIONS[op]}
    if name == "reference":
        return functions, None
    reason = _unsupported(module, op, shapes, dtype)
    if reason is not None:
        return None, reason
    try:
        error = probe(op, functions, shapes, device, dtype)
    except Exception as exc:  # noqa: BLE001  a vendor op may raise anything: that is the finding
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        return None, f"raised {type(exc).__name__}: {first_line}"
    tolerance = probe_tolerance(op, shapes, dtype)
    if not error <= tolerance:  # also catches NaN
        return None, f"max abs err {error:.1e} > {tolerance:.0e}"
    return functions, None


def _unsupported(module: ModuleType, op: str, shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    check = getattr(module, "unsupported", None)
    return None if check is None else check(op, shapes, dtype)
