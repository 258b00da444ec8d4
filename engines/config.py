"""Engine options: the keyword arguments of ``LLM``, and the one definition of every engine setting.

Each field's metadata (``setting``) holds its help text and its bounds or choices. The server's
per-model YAML keys (``server/engine_settings.py``), the ``serve`` flags (``server/cli.py``) and the
checks below are all derived from these fields, so they cannot drift apart.
"""

from dataclasses import dataclass, field, fields
from typing import Any

from engines.parallel_config import ParallelConfig

COMPILE_MODES = ("auto", "off", "on")
COMPILE_ENV_VAR = "XINSERVE_COMPILE"  # the mode when a config leaves ``compile`` unset
DTYPES = ("auto", "float32", "float16", "bfloat16")  # "auto" (or None): the checkpoint's dtype
# vLLM's --quantization names: the checkpoint formats of engines/quantization/formats/, and the schemes a
# float checkpoint is quantized to on the fly (fp8, w8a8; engines/quantization/online.py)
QUANTIZATION_METHODS = ("fp8", "w8a8", "compressed-tensors")


def setting(help: str, *, ge: int | None = None, gt: float | None = None, le: float | None = None,
            choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A field's metadata: its help text, and the bounds or choices a value other than None must meet
    (``gt`` and ``le`` together: a half-open range)."""
    if (gt is None) != (le is None):
        raise TypeError("gt and le go together")
    checks = {"ge": ge, "gt": gt, "le": le, "choices": choices}
    return {"help": help, **{k: v for k, v in checks.items() if v is not None}}


@dataclass(slots=True)
class EngineConfig:
    model: str = field(metadata=setting("Hugging Face model directory"))
    device: str = field(default="cpu", metadata=setting("cpu, cuda:N, npu:N or musa:N"))
    tokenizer: str | None = field(default=None, metadata=setting("tokenizer directory if not the model's"))
    dtype: str | None = field(default=None, metadata=setting(
        "weights and activations; auto: the checkpoint's dtype", choices=DTYPES))
    max_model_len: int | None = field(default=None, metadata=setting(
        "longest prompt + output in tokens (default: the model's max_position_embeddings)", ge=1))
    max_num_seqs: int = field(default=64, metadata=setting("requests one step runs at most", ge=1))
    max_num_batched_tokens: int = field(default=2048, metadata=setting(
        "token budget of one step (prefill chunks + decodes)", ge=1))
    block_size: int | None = field(default=None, metadata=setting(
        "tokens per KV block (default: the platform's, 128 on Ascend, 64 on MUSA, 16 elsewhere)", ge=1))
    num_kv_blocks: int | None = field(default=None, metadata=setting(
        "KV blocks in the pool (default: sized from free memory after a warm-up)", ge=1))
    kv_cache_memory_fraction: float | None = field(default=None, metadata=setting(
        "share of free device memory given to KV blocks (default: the platform's)", gt=0, le=1))
    enable_prefix_caching: bool = field(default=True, metadata=setting(
        "reuse the KV blocks of a prompt prefix seen before"))
    kernels: dict[str, str] | None = field(default=None, metadata=setting(
        "force kernel implementations, op=impl (kernels/registry.py; wins over XINSERVE_KERNELS)"))
    seed: int = field(default=0, metadata=setting("seeds the generator of unseeded sampled requests"))
    tensor_parallel_size: int = field(default=1, metadata=setting(
        "ranks per replica (engines/tp_runner.py); the server groups consecutive worker devices by it "
        "(--device cpu: N CPU ranks)", ge=1))
    # Where the ranks run and meet (None: all on ``device``); the server derives it from a worker group.
    parallel: ParallelConfig | None = field(default=None, metadata=setting("the ranks' devices and rendezvous"))
    compile: str | None = field(default=None, metadata=setting(
        "pure-decode steps compiled (CPU: torch.compile) or graph-captured (CUDA, Ascend, MUSA) per padded "
        "bucket: auto keeps a CPU bucket compiled only where it measures faster, on keeps every bucket that "
        "compiles, off runs eagerly (engines/graphs.py); default: $XINSERVE_COMPILE, else auto",
        choices=COMPILE_MODES))
    enforce_eager: bool = field(default=False, metadata=setting(
        "never compile or graph-capture decode steps (vLLM's name for compile off; wins over it)"))
    quantization: str | None = field(default=None, metadata=setting(
        "the weights' quantization: a quantized checkpoint's format (refused when the checkpoint is in "
        "another), or fp8 / w8a8 to quantize a float checkpoint at load (per-channel weights, per-token "
        "activations); default: what the checkpoint says", choices=QUANTIZATION_METHODS))

    def __post_init__(self) -> None:
        for f in fields(self):
            check_setting(f.name, getattr(self, f.name), f.metadata)


def check_setting(name: str, value: Any, meta: dict[str, Any]) -> None:
    """Raise ValueError naming ``name`` when ``value`` misses the bounds or choices of ``meta``."""
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        raise ValueError(f"{name} must be one of {', '.join(meta['choices'])}, got {value!r}")
    if "gt" in meta and not meta["gt"] < value <= meta["le"]:
        raise ValueError(f"{name} must be in ({meta['gt']}, {meta['le']}], got {value}")
    if "ge" in meta and value < meta["ge"]:
        raise ValueError(f"{name} must be at least {meta['ge']}, got {value}")
