"""Compiled and graph-captured decode steps, one per padded bucket (engines/worker/decode_buckets.py).

- CPU: ``torch.compile`` (inductor, ``dynamic=False``) of the decode forward per bucket, one bucket
  at a time by ``BucketCompiler`` on buffers of its own, so that it can run in a background thread
  beside the steps (engines/worker/warmup.py); a compiled bucket is installed between steps. With
  ``compile: auto`` a bucket stays compiled only where it measures faster than eager. Inductor's
  cache lives in ``$XINSERVE_CACHE_DIR/inductor`` (default ``~/.cache/xinserve/inductor``) unless
  TORCHINDUCTOR_CACHE_DIR says otherwise, so a restart loads the compiled code instead of compiling.
  An installed bucket's graph is then called without dynamo's frame and guards where that returns
  what the dynamo call did (engines/worker/direct_call.py).
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
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from xinserve.engines.config import COMPILE_ENV_VAR, COMPILE_MODES
from xinserve.engines.platforms import Platform
from xinserve.engines.worker.decode_buckets import DecodeBuffers, bucket_for, bucket_sizes
from xinserve.engines.worker.direct_call import GraphRecorder, direct_call
from xinserve.kernels.attention_metadata import AttentionMetadata
from xinserve.kernels.cache_dir import cache_dir

logger = logging.getLogger(__name__)

TIMING_ITERATIONS = 5


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
    """The function compiled or captured: (input_ids [B], positions [B], metadata) -> (logits [B, V],
    the final hidden states [B, hidden], which the MTP drafter reads: engines/speculative/mtp_runner.py)."""

    def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # ``forward``, not ``__call__``: a runner's forward hooks (the MTP runner's) are neither traced
        # into the bucket nor fired by a compile or timing run in the warm-up thread.
        hidden = model.forward(input_ids, positions, kv_cache, metadata)
        return model.compute_logits(hidden), hidden

    return forward


class DecodeGraphs:
    """The buckets that run compiled or captured; ``run`` takes a pure-decode step through them."""

    def __init__(self, buffers: DecodeBuffers, steps: dict[int, Callable[[], torch.Tensor]], kind: str,
                 compiler: "BucketCompiler | None" = None) -> None:
        self.buffers = buffers
        self.steps = steps  # bucket -> runs the bucket on the buffers: (logits [bucket, V], hidden [bucket, Hd])
        self.kind = kind  # "compiled" | "captured", for logs and benchmarks
        self.bucket_runs: Counter[int] = Counter()  # bucket -> steps it ran compiled or captured
        self.compiler = compiler  # compiles the other buckets (engines/worker/warmup.py); None once captured
        self.states = {size: "compiled" if size in steps else "eager" for size in buffers.sizes}
        self.errors: dict[int, str] = {}  # bucket -> why it failed, or why it stays eager
        # Expected use, for the order of compiling: pure-decode steps per bucket (compiled or not),
        # and the latest step's bucket.
        self.demand: Counter[int] = Counter()
        self.last_bucket: int | None = None
        self.hidden: torch.Tensor | None = None  # [rows, hidden] of the latest step run here; None if eager
        # Steps that verified drafts (decode rows of 1 + k per drafted sequence) per bucket, compiled or not.
        self.verify_runs: Counter[int] = Counter()
        # bucket -> its compiled graph called without dynamo (engines/worker/direct_call.py); dropped when stale
        self.direct: dict[int, Callable[[], list[torch.Tensor] | None]] = {}
        self.direct_runs: Counter[int] = Counter()  # bucket -> steps that ran through ``direct``

    def next_to_compile(self) -> int | None:
        """The bucket to compile next: the latest step's, else the most used, else the smallest."""
        waiting = [size for size, state in self.states.items() if state == "eager" and size not in self.errors]
        if not waiting:
            return None
        if self.last_bucket in waiting:
            return self.last_bucket
        return max(waiting, key=lambda size: (self.demand[size], -size))

    def install(self, size: int, compiled: Callable[..., torch.Tensor]) -> None:
        """Bind a bucket's compiled function to the step buffers and run it once on padding (its
        guards checked now, not in a step). Call between steps: the buffers are the steps'."""
        inputs = self.buffers.inputs(size)
        self.buffers.pad(size)
        want = compiled(*inputs)
        self.steps[size] = _bind(compiled, inputs)
        self.states[size] = "compiled"
        self._install_direct(size, inputs, want)

    def _install_direct(self, size: int, inputs: tuple, want: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Call the bucket's graph without dynamo from now on, where the compiler recorded exactly one
        graph for it and that graph, called directly, returns what the dynamo call did."""
        graphs = self.compiler.graphs.pop(size, None) if self.compiler is not None else None
        if graphs is None or len(graphs) != 1:
            return
        graph, example_inputs = graphs[0]
        call = direct_call(graph, example_inputs, self.compiler.buffers.inputs(size), inputs, self.compiler.model)
        got = None if call is None else call()
        if got is not None and len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)):
            self.direct[size] = call
        else:
            logger.info("decode bucket %d runs through dynamo: its graph cannot be called directly", size)

    def _outputs(self, size: int, step: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """A bucket's (logits, hidden): directly, else through dynamo (which recompiles what changed)."""
        direct = self.direct.get(size)
        outputs = None if direct is None else direct()
        if outputs is None:
            self.direct.pop(size, None)  # its kernels changed: dynamo's guards decide from now on
            return step()
        self.direct_runs[size] += 1
        return outputs

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
            self.last_bucket = size
        step = self.steps.get(size)  # None too for a step larger than every bucket (size None)
        if step is None or not self.buffers.fill(size, input_ids, positions, metadata, host_seq_lens[:num_rows]):
            return None
        try:
            logits, hidden = self._outputs(size, step)
        except Exception as exc:  # noqa: BLE001  a recompile or replay that fails: this bucket goes eager
            logger.warning("%s decode for bucket %d failed (%s: %s); it runs eagerly from now on",
                           self.kind, size, type(exc).__name__, first_line(exc))
            del self.steps[size]
            self.direct.pop(size, None)
            self.states[size], self.errors[size] = "failed", first_line(exc)
            return None
        self.bucket_runs[size] += 1
        self.verify_runs[size] += verifies
        self.hidden = hidden[:num_rows]
        logits = logits[:num_rows]  # padded rows are never sampled
        return logits if logits_indices is None else logits.index_select(0, logits_indices)


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
    """Capture (accelerators) the decode forward per bucket now, or (CPU) the buckets with their
    ``BucketCompiler``, every bucket eager until compiled; None when every bucket runs eagerly (mode
    "off", nothing captured). ``capture_hooks``: the chosen kernels' (``KernelSelection.capture_hooks``),
    around each capture."""
    if mode == "off":
        return None
    sizes = sizes or bucket_sizes(max_rows)
    buffers = DecodeBuffers(sizes, max_model_len, block_size, scratch_block, platform.device)
    forward = decode_forward(model, kv_cache)
    if not platform.captures_graphs:
        copy = DecodeBuffers(sizes, max_model_len, block_size, scratch_block, platform.device)
        return DecodeGraphs(buffers, {}, "compiled", BucketCompiler(forward, copy, mode, platform, model))
    steps = _capture(forward, buffers, platform, capture_hooks)
    if not steps:
        return None
    logger.info("decode buckets %s run captured; the others eagerly", sorted(steps))
    return DecodeGraphs(buffers, steps, "captured")


def use_inductor_cache() -> str:
    """Point inductor's cache at ``$XINSERVE_CACHE_DIR/inductor`` unless TORCHINDUCTOR_CACHE_DIR is
    set already; returns the one in use."""
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))


class BucketCompiler:
    """Compiles the decode forward for one bucket at a time (CPU), on buffers of its own (the steps'
    stay the steps'), so it can run in a thread beside them; ``DecodeGraphs.install`` binds the
    result to the step buffers."""

    def __init__(self, forward: Callable, buffers: DecodeBuffers, mode: str, platform: Platform,
                 model: torch.nn.Module | None = None) -> None:
        use_inductor_cache()
        self.forward = forward
        self.model = model  # whose kernel ops a directly called graph checks (engines/worker/direct_call.py)
        self.recorder = GraphRecorder()
        self.graphs: dict[int, list] = {}  # bucket -> the graphs its compile recorded, until installed
        self._compiled: Callable[..., torch.Tensor] | None = None
        self.buffers = buffers
        self.mode = mode
        self.platform = platform

    @property
    def compiled(self) -> Callable[..., torch.Tensor]:
        """The compiled forward, made on first use: dynamo and ``torch.compile`` import seconds of CPU
        (dynamo, inductor), which belong in the warm-up thread, after ready, not in the constructor."""
        if self._compiled is None:
            # Every bucket of every engine in this process is a compiled variant of the one ``forward``
            # code object (guarded on its shapes and its model): let each build add its own.
            torch._dynamo.config.recompile_limit += len(self.buffers.sizes)
            self._compiled = torch.compile(self.forward, dynamic=False, backend=self.recorder)
        return self._compiled

    @torch.inference_mode()
    def __call__(self, size: int) -> Callable[..., torch.Tensor] | None:
        """The compiled function for bucket ``size``, or None where eager measured faster (mode
        "auto"). Raises what inductor raised."""
        inputs = self.buffers.inputs(size)
        self.buffers.pad(size)
        start = time.perf_counter()
        self.recorder.start()
        self.compiled(*inputs)  # compiles (or loads from the cache)
        self.graphs[size] = self.recorder.taken()
        took = time.perf_counter() - start
        if self.mode != "auto":
            logger.info("decode bucket %d compiled in %.1f s", size, took)
            return self.compiled
        eager_s = _median_seconds(_bind(self.forward, inputs), self.platform)
        compiled_s = _median_seconds(_bind(self.compiled, inputs), self.platform)
        keep = compiled_s < eager_s
        if not keep:
            self.graphs.pop(size, None)  # nothing will install it
        logger.info("decode bucket %d compiled in %.1f s: %.3f ms compiled vs %.3f ms eager -> %s",
                    size, took, compiled_s * 1e3, eager_s * 1e3, "compiled" if keep else "eager")
        return self.compiled if keep else None


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


def _bind(function: Callable, inputs: tuple) -> Callable[[], torch.Tensor]:
    return lambda: function(*inputs)


def _median_seconds(function: Callable[[], object], platform: Platform) -> float:
    function()
    times = []
    for _ in range(TIMING_ITERATIONS):
        start = time.perf_counter()
        function()
        platform.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
