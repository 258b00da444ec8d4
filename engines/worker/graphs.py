"""Compiled and graph-captured decode steps, one per padded bucket (engines/worker/decode_buckets.py).

- CPU: ``torch.compile`` (inductor, ``dynamic=False``) of the decode step per bucket, in a child
  process (engines/compile/child.py) that saves each compiled bucket as an artifact; the worker loads
  it and installs it between steps (engines/worker/warmup.py), so compiling never holds the serving
  process's GIL. With ``compile: auto`` a bucket stays compiled only where it measured faster than
  eager. Inductor's cache lives in ``$XINSERVE_CACHE_DIR/inductor`` (default
  ``~/.cache/xinserve/inductor``) unless TORCHINDUCTOR_CACHE_DIR says otherwise; the child and the
  worker share it. An installed bucket is called without its guards (checked once, at install: its
  inputs are the same buffers, parameters and cache at every step).
- CUDA / Ascend / MUSA: each bucket's forward is captured once with the device's graph API
  (``torch.cuda.CUDAGraph``, ``torch.npu.NPUGraph``, ``torch.musa.MUSAGraph`` when torch_musa has
  it), largest bucket first so the smaller ones share its memory pool; a step copies its inputs
  into the static buffers and replays. A kernel that needs more says so itself (kernels/ops.py):
  each capture is wrapped in the chosen kernels' capture hooks, whose callbacks run before each
  replay (Ascend's paged attention takes the context lengths on the host, which a graph would freeze
  at capture: kernels/ascend/ops.py records its calls as task groups and re-issues them with the step's
  lengths).

  Capture needs a quiet stream, so it runs before the worker reports ready (all buckets).

Only pure-decode steps take this path (speculative verification steps included: a drafted sequence's
1 + k rows are decode rows, engines/worker/decode_rows.py); steps with prefill stay eager. A failure to compile or
capture is logged and leaves that decode eager (never fatal). Each bucket has a state for /health:
``eager`` (not compiled yet, or kept eager because eager measured faster), ``compiling``,
``compiled`` (or captured), ``failed`` (with the error's first line; it runs eagerly).
"""

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from xinserve.engines.compile.decode_step import decode_step
from xinserve.engines.config import COMPILE_ENV_VAR, COMPILE_MODES
from xinserve.engines.platforms import Platform
from xinserve.engines.worker.decode_buckets import DecodeBuffers, bucket_for, bucket_sizes
from xinserve.kernels.attention_metadata import AttentionMetadata
from xinserve.kernels.cache_dir import cache_dir

logger = logging.getLogger(__name__)


def effective_mode(compile_mode: str | None) -> str:
    """"auto" | "on" | "off": ``EngineConfig.compile`` (``enforce_eager`` is already mapped onto it); an
    unset mode is $XINSERVE_COMPILE's (the test suite sets "off", so only the tests about compiling pay
    for it), else "auto"."""
    if compile_mode is not None:
        return compile_mode
    mode = os.environ.get(COMPILE_ENV_VAR, "auto").strip().lower()
    if mode not in COMPILE_MODES:
        raise ValueError(f"{COMPILE_ENV_VAR} must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    return mode


def inductor_cache_dir() -> Path:
    return cache_dir() / "inductor"


def decode_forward(model: torch.nn.Module, kv_cache: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """What an accelerator captures: (input_ids [B], positions [B], metadata) -> (logits [B, V], the final
    hidden states [B, hidden]) of ``decode_step`` (engines/compile/decode_step.py) on this model and cache."""

    def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_step(model, kv_cache, input_ids, positions, metadata)

    return forward


class StaleArtifact(ValueError):
    """A compiled bucket that does not compute this worker's step (made for another model or settings)."""


class DecodeGraphs:
    """The buckets that run compiled or captured; ``run`` takes a pure-decode step through them."""

    def __init__(self, buffers: DecodeBuffers, steps: dict[int, Callable[[], torch.Tensor]], kind: str,
                 model: torch.nn.Module | None = None, kv_cache: torch.Tensor | None = None,
                 compiles: bool = False) -> None:
        self.buffers = buffers
        self.steps = steps  # bucket -> runs the bucket on the buffers: (logits [bucket, V], hidden [bucket, Hd])
        self.kind = kind  # "compiled" | "captured", for logs and benchmarks
        self.model = model
        self.kv_cache = kv_cache
        self.compiles = compiles  # CPU: buckets still to compile (engines/worker/warmup.py); captured ones never
        self.bucket_runs: Counter[int] = Counter()  # bucket -> steps it ran compiled or captured
        self.states = {size: "compiled" if size in steps else "eager" for size in buffers.sizes}
        self.errors: dict[int, str] = {}  # bucket -> why it failed, or why it stays eager
        self.demand: Counter[int] = Counter()  # pure-decode steps per bucket (compiled or not)
        self.hidden: torch.Tensor | None = None  # [rows, hidden] of the latest step run here; None if eager
        # Steps that verified drafts (decode rows of 1 + k per drafted sequence) per bucket, compiled or not.
        self.verify_runs: Counter[int] = Counter()

    def compile_order(self) -> list[int]:
        """The buckets not compiled yet, the most used first, then the smallest."""
        waiting = [size for size, state in self.states.items() if state == "eager" and size not in self.errors]
        return sorted(waiting, key=lambda size: (-self.demand[size], size))

    def install(self, size: int, compiled: Callable) -> None:
        """Bind a bucket's compiled step (engines/compile/artifacts.py ``load``) to the step buffers, the
        model and the KV cache. Call between steps: the buffers are the steps'. It is run once on padding
        and must agree with the eager step there, else StaleArtifact: its cache key
        (engines/compile/spec.py) names the shapes and settings it was made for, and this check catches
        what a key could miss. Its guards are not evaluated: they compare the dispatch keys the child's
        tensors had under its tracing context, which differ from the worker's without changing the code."""
        inputs = self.buffers.inputs(size)
        self.buffers.pad(size)
        args = (self.model, self.kv_cache, *inputs)
        compiled.disable_guard_check()
        got, want = compiled(*args), decode_step(*args)
        if not all(_close(a, b) for a, b in zip(got, want, strict=True)):
            raise StaleArtifact("its output on padding differs from the eager step's (made for another model?)")
        self.steps[size] = _bound_to_kernels(compiled, args, self.model)
        self.states[size] = "compiled"
        self.errors.pop(size, None)

    def report(self) -> dict:
        """For /health: the kind and each bucket's state."""
        return {"kind": self.kind, "buckets": {
            str(size): {"state": state, "error": self.errors.get(size)} for size, state in self.states.items()}}

    @property
    def steps_run(self) -> int:
        """Steps that ran compiled or captured (tests and benchmarks read it)."""
        return self.bucket_runs.total()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            host_seq_lens: np.ndarray, logits_indices: torch.Tensor | None,
            verifies: bool = False) -> torch.Tensor | None:
        """The logits of a pure-decode step's sampled rows, or None when its bucket runs eagerly
        (the caller then runs the step as it is). ``host_seq_lens``: [rows] int32, the rows' context
        lengths on the host. ``verifies``: the step checks drafts (counted for /health and tests:
        ``verify_runs``)."""
        num_rows = input_ids.shape[0]
        self.hidden = None
        size = bucket_for(num_rows, self.buffers.sizes)
        if size is not None:
            self.demand[size] += 1
        step = self.steps.get(size)  # None too for a step larger than every bucket (size None)
        if step is None or not self.buffers.fill(size, input_ids, positions, metadata, host_seq_lens[:num_rows]):
            return None
        try:
            outputs = step()
            if outputs is None:
                raise StaleArtifact("a layer's kernels changed since it was compiled")
            logits, hidden = outputs
        except Exception as exc:  # noqa: BLE001  a replay that fails: this bucket goes eager
            logger.warning("%s decode for bucket %d failed (%s: %s); it runs eagerly from now on",
                           self.kind, size, type(exc).__name__, first_line(exc))
            del self.steps[size]
            self.states[size], self.errors[size] = "failed", first_line(exc)
            return None
        self.bucket_runs[size] += 1
        self.verify_runs[size] += verifies
        self.hidden = hidden[:num_rows]
        logits = logits[:num_rows]  # padded rows are never sampled
        return logits if logits_indices is None else logits.index_select(0, logits_indices)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to the rounding of another summation order; a wrong artifact is off by the values' size."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    scale = want.float().abs().max().clamp(min=1.0)
    return bool(((got.float() - want.float()).abs().max() <= 0.02 * scale).item())


def _bound_to_kernels(compiled: Callable, args: tuple, model: torch.nn.Module | None) -> Callable:
    """``compiled`` on ``args``; None once a layer's kernel ops are no longer those it was compiled with
    (engines/worker/warmup.py swaps them between steps: the compiled code still calls the old ones)."""
    modules = model.modules() if model is not None else ()
    holders = [(module, module.ops) for module in modules if getattr(module, "ops", None) is not None]

    def call() -> tuple[torch.Tensor, torch.Tensor] | None:
        for module, ops in holders:
            if module.ops is not ops:
                return None
        return compiled(*args)

    return call


@torch.inference_mode()
def build_decode_graphs(
    model: torch.nn.Module,
    kv_cache: torch.Tensor,
    platform: Platform,
    mode: str,
    max_rows: int,
    max_model_len: int,
    block_size: int,
    scratch_block: int,
    sizes: list[int] | None = None,
    capture_hooks: Sequence[Callable] = (),
) -> DecodeGraphs | None:
    """Capture (accelerators) the decode forward per bucket now, or (CPU) the buckets to compile
    (engines/worker/warmup.py), every bucket eager until installed; None when every bucket runs eagerly (mode
    "off", nothing captured). ``capture_hooks``: the chosen kernels' (``KernelSelection.capture_hooks``),
    around each capture."""
    if mode == "off":
        return None
    sizes = sizes or bucket_sizes(max_rows)
    buffers = DecodeBuffers(sizes, max_model_len, block_size, scratch_block, platform.device)
    if not platform.captures_graphs:
        use_inductor_cache()  # before the compile child starts: it inherits the environment
        return DecodeGraphs(buffers, {}, "compiled", model, kv_cache, compiles=True)
    steps = _capture(decode_forward(model, kv_cache), buffers, platform, capture_hooks)
    if not steps:
        return None
    logger.info("decode buckets %s run captured; the others eagerly", sorted(steps))
    return DecodeGraphs(buffers, steps, "captured")


def use_inductor_cache() -> str:
    """Point inductor's cache at ``$XINSERVE_CACHE_DIR/inductor`` unless TORCHINDUCTOR_CACHE_DIR is
    set already; returns the one in use."""
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))


def _capture(forward: Callable, buffers: DecodeBuffers, platform: Platform, hooks: Sequence[Callable]) -> dict:
    api = getattr(torch, platform.kind, None)
    graph_class = getattr(api, platform.graph_class, None)
    if graph_class is None:
        logger.info("torch.%s exposes no graph capture here; decode runs eagerly", platform.kind)
        return {}
    pool = api.graph_pool_handle()
    steps = {}
    # Largest first: the smaller graphs then fit in the memory pool the largest one reserved.
    for size in reversed(buffers.sizes):
        inputs = buffers.inputs(size)
        buffers.pad(size)
        try:
            forward(*inputs)  # warm-up: lazy initialisation and workspace allocation happen outside capture
            platform.synchronize()
            graph = graph_class()
            with ExitStack() as around:
                before_replay = [around.enter_context(hook()) for hook in hooks]
                with api.graph(graph, pool=pool):
                    out = forward(*inputs)
        except Exception as exc:  # noqa: BLE001  a driver or operator that cannot be captured: stay eager
            logger.warning("capturing the decode step for bucket %d failed (%s: %s); decode runs eagerly",
                           size, type(exc).__name__, first_line(exc))
            return {}
        steps[size] = _replayer(graph, out, before_replay)
        logger.info("captured the decode step for batch bucket %d", size)
    return steps


def _replayer(graph, out: torch.Tensor, before_replay: list[Callable[[], None]]) -> Callable[[], torch.Tensor]:
    def replay() -> torch.Tensor:
        for update in before_replay:
            update()
        graph.replay()
        return out

    return replay


def first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


@torch.inference_mode()
def capture_memory_probe(model: torch.nn.Module, kv_cache: torch.Tensor, platform: Platform, mode: str,
                         max_rows: int, max_model_len: int, block_size: int,
                         scratch_block: int, capture_hooks: Sequence[Callable] = ()) -> DecodeGraphs | None:
    """The largest bucket captured on the warm-up cache, to be held while the free memory is read,
    so the KV pool leaves room for the graphs' memory pool (which the smaller buckets share).
    None on the CPU (compiled code takes no device memory) or when graphs are off."""
    if mode == "off" or not platform.captures_graphs:
        return None
    return build_decode_graphs(model, kv_cache, platform, mode, max_rows, max_model_len, block_size,
                               scratch_block, sizes=[bucket_sizes(max_rows)[-1]], capture_hooks=capture_hooks)
