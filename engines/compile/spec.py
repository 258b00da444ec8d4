"""What a compile child builds, and the cache directory its artifacts go to.

A bucket's compiled step depends on the model's architecture and shapes, the engine settings that
shape the step (dtype, block size, KV cache, LoRA slots...), the kernels chosen, the bucket sizes,
torch, the CPU's instruction set and the code traced (this package's ``engines`` and ``kernels``). The
key hashes all of them, so a changed one compiles anew and never loads a stale artifact; the weights'
values are not in it (a compiled step reads them from the live model at each call).
"""

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import torch

from xinserve.engines.config import EngineConfig
from xinserve.kernels.cache_dir import cache_dir
from xinserve.kernels.cpu.cpp_build import cpu_flags

# Settings that never change a compiled decode step: left out of the key, so that a server's workers and
# ``xinserve warmup`` (which set some of them differently) share the artifacts.
NOT_IN_KEY = ("tokenizer", "seed", "parallel", "enforce_eager", "warm_up_in_background", "ready_when_warm",
              "max_cpu_threads", "async_scheduling", "kv_events_config", "kv_offloading_size", "kv_transfer_config",
              "data_parallel_rank", "max_cpu_loras", "lora_modules", "kv_cache_memory_fraction",
              "enable_prefix_caching", "max_num_batched_tokens", "classifier_from_token")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the xinserve package: engines/, kernels/ under it
TRACED_FOLDERS = ("engines", "kernels")


@dataclass(frozen=True, slots=True)
class CompileSpec:
    """Everything a child needs to rebuild the worker's runner and compile its buckets."""

    config: EngineConfig  # the child's: compile off, every kernel forced to the worker's choice, its KV pool size
    block_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    sizes: tuple[int, ...]  # every bucket (the step buffers are laid out for all of them)
    order: tuple[int, ...]  # the buckets to compile, in order (not in the key)
    mode: str  # "on" | "auto" (engines/worker/graphs.py effective_mode)
    kv_inference: bool  # whether the worker's KV cache is an inference tensor (the child makes its own alike)
    # The worker's torch threads when the child started: inductor writes the count into its OpenMP loops, so a
    # bucket runs with it whatever the worker's count later. Not in the key: the count is timed at each start
    # (engines/worker/thread_split.py) and may come out otherwise (before and after the C++ kernels were built),
    # which would compile every bucket again for the same code.
    threads: int
    # Compile at the lowest CPU priority: the worker serves meanwhile (ready first). Not when nothing is served
    # until the compile ends (ready_when_warm, ``xinserve warmup``): it would only wait longer. Not in the key.
    low_priority: bool

    @classmethod
    def of(cls, config: EngineConfig, runner, max_model_len: int) -> "CompileSpec":
        """The spec of ``runner``'s buckets with its kernels as chosen now (after any swap)."""
        graphs = runner.decode_graphs
        child_config = replace(config, compile="off", warm_up_in_background=False, ready_when_warm=False,
                               kernels=dict(runner.kernels.chosen), num_kv_blocks=runner.scratch_block)
        return cls(child_config, runner.block_size, tuple(runner.eos_token_ids), max_model_len,
                   tuple(graphs.buffers.sizes), tuple(graphs.compile_order()), runner.compile_mode,
                   runner.kv_cache.is_inference(), torch.get_num_threads(),
                   config.warm_up_in_background and not config.ready_when_warm)

    def key(self) -> str:
        settings = {name: value for name, value in dataclasses.asdict(self.config).items() if name not in NOT_IN_KEY}
        text = json.dumps({"config": settings, "model": _model_files_digest(self.config.model),
                           "block_size": self.block_size, "max_model_len": self.max_model_len,
                           "sizes": sorted(self.sizes), "mode": self.mode, "kv_inference": self.kv_inference, "torch": torch.__version__,
                           "python": sys.version, "cpu": cpu_flags(), "code": source_digest()},
                          sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def directory(self) -> Path:
        """``$XINSERVE_CACHE_DIR/buckets/<key>``: the manifest and one artifact per compiled bucket."""
        return buckets_dir() / self.key()


def buckets_dir() -> Path:
    return cache_dir() / "buckets"


def _model_files_digest(model: str) -> str:
    """The model's config (its architecture and shapes), not its weights."""
    path = Path(model) / "config.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else model


@cache
def source_digest() -> str:
    """The code a compiled step traced: every Python file of engines/ and kernels/, and the C++ kernel sources."""
    digest = hashlib.sha256()
    for folder in TRACED_FOLDERS:
        for path in sorted((PACKAGE_ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".cpp", ".h") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(PACKAGE_ROOT)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()
