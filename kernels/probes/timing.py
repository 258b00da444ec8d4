"""How fast each correct kernel candidate is at the model's shapes, so the registry can pick by
speed instead of by list order (one chip of a fleet may then choose differently from another).

Only ops whose cost grows with the context or the batch (or a fused kernel may save a step's passes
over: kernels/probes/elementwise_timing.py) are timed, on one workload each shaped like a busy decode or
prefill step of this model; a few iterations after a warm-up, the median kept.
Timings are cached in a JSON file keyed by everything that decides them (op, implementation, shapes,
dtype, device name, torch version), so a restart or a second worker on the same card does not time
again.
"""

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from xinserve.kernels import kv_quant
from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.cache_dir import cache_dir
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes import elementwise_timing
from xinserve.kernels.probes import linear as linear_probes
from xinserve.kernels.probes import lora as lora_probes
from xinserve.kernels.probes import quant as quant_probes

ITERATIONS = 5
DECODE_SEQS, DECODE_CONTEXT = 8, 512  # a busy decode step: batch 8 at 512 tokens of context
PREFILL_TOKENS = 256  # a prompt chunk after an as long cached prefix


def cache_path() -> Path:
    return cache_dir() / "kernel_timings.json"


def _synchronize(device: torch.device) -> None:
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and module is not None and hasattr(module, "synchronize"):
        module.synchronize()


def _device_name(device: torch.device) -> str:
    module = getattr(torch, device.type, None)
    try:
        return module.get_device_name(device) if device.type != "cpu" else platform.processor() or platform.machine()
    except Exception:  # noqa: BLE001  a name is only part of the cache key
        return device.type


def _decode_workload(fn: dict[str, Callable], shapes: ModelShapes, device: torch.device,
                     dtype: torch.dtype) -> Callable[[], object]:
    bs = shapes.block_size
    per_seq = -(-DECODE_CONTEXT // bs)
    tables_np = np.arange(DECODE_SEQS * per_seq, dtype=np.int32).reshape(DECODE_SEQS, per_seq)
    lens_np = np.full(DECODE_SEQS, DECODE_CONTEXT, np.int32)
    shape = (DECODE_SEQS * per_seq, bs, shapes.num_kv_heads, shapes.head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    query = torch.randn(DECODE_SEQS, shapes.num_heads, shapes.head_dim, dtype=dtype, device=device)
    tables, lens = torch.from_numpy(tables_np).to(device), torch.from_numpy(lens_np).to(device)
    gather = build_decode_gather(tables_np, lens_np, bs, device)
    scale = shapes.head_dim**-0.5
    attend = fn["paged_decode_attention"]
    return lambda: attend(query, key_cache, value_cache, tables, lens, scale, gather)


def _prefill_workload(fn: dict[str, Callable], shapes: ModelShapes, device: torch.device,
                      dtype: torch.dtype) -> Callable[[], object]:
    bs = shapes.block_size
    seq_len = 2 * PREFILL_TOKENS
    blocks = -(-seq_len // bs)
    shape = (blocks, bs, shapes.num_kv_heads, shapes.head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.arange(blocks, dtype=torch.int32, device=device).view(1, blocks)
    query = torch.randn(PREFILL_TOKENS, shapes.num_heads, shapes.head_dim, dtype=dtype, device=device)
    scale = shapes.head_dim**-0.5
    attend = fn["paged_prefill_attention"]
    return lambda: attend(query, key_cache, value_cache, tables, [0, PREFILL_TOKENS], [seq_len], scale)


def _write_kv_workload(fn: dict[str, Callable], shapes: ModelShapes, device: torch.device,
                       dtype: torch.dtype) -> Callable[[], object]:
    # one decode step of a batch of DECODE_SEQS x 4: as many new tokens, one per sequence, into a pool
    tokens, bs = 4 * DECODE_SEQS, shapes.block_size
    kv_dtype = shapes.kv_cache_dtype or dtype
    width = kv_quant.head_width(shapes.head_dim, kv_dtype)
    caches = [torch.zeros(tokens, bs, shapes.num_kv_heads, width, dtype=kv_dtype, device=device) for _ in range(2)]
    key, value = (torch.randn(tokens, shapes.num_kv_heads, shapes.head_dim, dtype=dtype, device=device)
                  for _ in range(2))
    slots = torch.arange(tokens, dtype=torch.int64, device=device) * bs + bs // 2
    write = fn["write_kv"]
    return lambda: write(key, value, *caches, slots)


WORKLOADS = {"decode_attention": _decode_workload, "prefill_attention": _prefill_workload, "write_kv": _write_kv_workload,
             **quant_probes.WORKLOADS, **linear_probes.WORKLOADS, **lora_probes.WORKLOADS, **elementwise_timing.WORKLOADS}


def measure(op: str, functions: dict[str, Callable], shapes: ModelShapes, device: torch.device,
            dtype: torch.dtype) -> float:
    """Median seconds of one call of the op's workload."""
    with torch.inference_mode():
        run = WORKLOADS[op](functions, shapes, device, dtype)
        run()  # warm-up: first-call compiles and allocations
        _synchronize(device)
        times = []
        for _ in range(ITERATIONS):
            start = time.perf_counter()
            run()
            _synchronize(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def fastest(timings: dict[str, float], order: tuple[str, ...]) -> str:
    """The fastest implementation; a tie goes to the one earlier in the platform's preference."""
    return min(timings, key=lambda name: (timings[name], order.index(name) if name in order else len(order)))


class TimingCache:
    """op timings by key, read once and written through (a small JSON file)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_path()
        try:
            self.entries: dict[str, float] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}

    @staticmethod
    def key(op: str, impl: str, functions: dict[str, Callable], shapes: ModelShapes, device: torch.device,
            dtype: torch.dtype) -> str:
        # A kernel built from source says which build it is, so a rebuilt one is timed again.
        builds = sorted(str(getattr(f, "build_key", "")) for f in functions.values())
        text = repr((op, impl, builds, shapes, str(dtype), device.type, _device_name(device), torch.__version__))
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def get(self, key: str) -> float | None:
        return self.entries.get(key)

    def put(self, key: str, seconds: float) -> None:
        self.entries[key] = seconds
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(self.entries, indent=0))
            temporary.replace(self.path)  # atomic: concurrent workers never read half a file
        except OSError:
            pass  # a read-only home only costs a re-measurement next time
