"""Engine options (the keyword arguments of ``LLM`` and the per-model YAML settings)."""

from dataclasses import dataclass

from engines.parallel_config import ParallelConfig

COMPILE_MODES = ("auto", "off", "on")
COMPILE_ENV_VAR = "XINSERVE_COMPILE"  # the mode when a config leaves ``compile`` unset


@dataclass(slots=True)
class EngineConfig:
    model: str
    device: str = "cpu"
    tokenizer: str | None = None  # a separate tokenizer directory; None = the model's
    dtype: str | None = None  # "float32" | "float16" | "bfloat16"; None = the checkpoint's dtype
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    block_size: int | None = None  # None = the platform default (128 on Ascend, 16 elsewhere)
    num_kv_blocks: int | None = None  # explicit pool size; else sized from free memory
    kv_cache_memory_fraction: float | None = None  # None = the platform default
    enable_prefix_caching: bool = True
    kernels: dict[str, str] | None = None  # op -> implementation, forced (kernels/registry.py)
    seed: int = 0  # seeds the shared generator used by unseeded sampled requests
    # Ranks of one replica (engines/tp_runner.py); ``parallel`` places them (None: all on ``device``)
    tensor_parallel_size: int = 1
    parallel: ParallelConfig | None = None
    # Pure-decode steps in padded buckets, compiled (CPU: torch.compile) or graph-captured (CUDA,
    # Ascend, MUSA) per bucket: "auto" keeps a CPU bucket compiled only where it measures faster,
    # "on" keeps every bucket that compiles, "off" runs eagerly (engines/graphs.py). None: the
    # XINSERVE_COMPILE environment variable, else "auto".
    compile: str | None = None
    enforce_eager: bool = False  # vLLM's name for compile "off"; wins over ``compile``

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.compile is not None and self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
