"""Engine options: the keyword arguments of ``LLM``, and the one definition of every engine setting.

Each field's metadata (``setting``) holds its help text and its bounds or choices. The server's
per-model YAML keys (``server/engine_settings.py``), the ``serve`` flags (``server/cli/setting_flags.py``) and the
checks below are all derived from these fields, so they cannot drift apart.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from xinserve.engines.kv.events import KVEventsConfig
from xinserve.engines.kv.transfer_config import parse_kv_transfer_config
from xinserve.engines.parallel.parallel_config import ParallelConfig
from xinserve.engines.speculative.config import parse_speculative_config, uses_mtp

COMPILE_MODES = ("auto", "off", "on")
COMPILE_ENV_VAR = "XINSERVE_COMPILE"  # the mode when a config leaves ``compile`` unset
DTYPES = ("auto", "float32", "float16", "bfloat16")  # "auto" (or None): the checkpoint's dtype
# vLLM's --quantization names: the checkpoint formats of engines/quantization/formats/, and the schemes a
# float checkpoint is quantized to on the fly (fp8, w8a8; engines/quantization/online.py)
QUANTIZATION_METHODS = ("fp8", "w8a8", "compressed-tensors", "ascend", "gptq", "awq")
# --kv-cache-dtype's spellings: the keys of kernels/kv_quant.KV_CACHE_DTYPES (tests/engines/test_engine_config.py
# pins that), written out here because that module imports torch and the HTTP process reads this config
# before it spawns its workers (server/http/heavy_imports.py).
KV_CACHE_DTYPE_NAMES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "int8")
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner (less draft)
CONVERTS = ("embed", "classify")  # vLLM's --convert for a pooling runner


def setting(help: str, *, ge: int | None = None, gt: float | None = None, le: float | None = None,
            choices: tuple[str, ...] | None = None, check: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """A field's metadata: its help text, and the bounds or choices a value other than None must meet
    (``gt`` and ``le`` together: a half-open range); ``check``: a parser that raises ValueError on a
    bad value (for a structured one, such as ``speculative_config``)."""
    if (gt is None) != (le is None):
        raise TypeError("gt and le go together")
    checks = {"ge": ge, "gt": gt, "le": le, "choices": choices, "check": check}
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
        "ranks per replica (engines/parallel/tp_runner.py); the server groups consecutive worker devices by it "
        "(--device cpu: N CPU ranks)", ge=1))
    pipeline_parallel_size: int = field(default=1, metadata=setting(
        "pipeline stages per replica, each a contiguous range of layers (engines/parallel/pipeline_parallel.py); a "
        "replica has tensor_parallel_size x pipeline_parallel_size ranks", ge=1))
    enable_expert_parallel: bool = field(default=False, metadata=setting(
        "place whole routed experts on the tensor-parallel ranks and exchange tokens all-to-all, instead of "
        "splitting every expert (engines/models/expert_parallel.py)"))
    # Where the ranks run and meet (None: all on ``device``); the server derives it from a worker group.
    parallel: ParallelConfig | None = field(default=None, metadata=setting("the ranks' devices and rendezvous"))
    compile: str | None = field(default=None, metadata=setting(
        "pure-decode steps compiled (CPU: torch.compile) or graph-captured (CUDA, Ascend, MUSA) per padded "
        "bucket: auto keeps a CPU bucket compiled only where it measures faster, on keeps every bucket that "
        "compiles, off runs eagerly (engines/worker/graphs.py); default: $XINSERVE_COMPILE, else auto",
        choices=COMPILE_MODES))
    # vLLM's alias, kept so its flag and ``LLM(enforce_eager=True)`` work: ``__post_init__`` maps it onto
    # ``compile``, the one setting the engine reads.
    enforce_eager: bool = field(default=False, metadata=setting(
        "never compile or graph-capture decode steps: vLLM's alias for compile off (wins over compile)"))
    warm_up_in_background: bool = field(default=True, metadata=setting(
        "report ready once the model is loaded and the eager path warmed, then build C++ kernels not built yet "
        "and compile the CPU decode buckets (in a child process) in the background, swapping each in between "
        "steps (engines/worker/warmup.py); off: do both before ready"))
    ready_when_warm: bool = field(default=False, metadata=setting(
        "a server's worker reports ready only once its warm-up settled (kernels built, decode buckets compiled "
        "or loaded; meanwhile /health shows the worker \"starting\" with the progress, 503 while no worker of "
        "the model is ready): for autoscaled replicas, which are judged by their first minutes; off: ready first, "
        "warm in the background"))
    max_cpu_threads: int | None = field(default=None, metadata=setting(
        "a CPU engine times its decode step at start with its torch threads and with this many and keeps the faster, "
        "cached per machine and shape under $XINSERVE_CACHE_DIR (engines/worker/thread_split.py); the server sets it to "
        "the cores a CPU worker may use unless cpu_threads is set; None: no timing", ge=1))
    async_scheduling: bool = field(default=True, metadata=setting(
        "the server's worker never waits for the HTTP process: a step's outputs go out without blocking, or, "
        "while the socket is full, through a sender thread that merges them (server/worker/output_sender.py); and "
        "step N+1 is scheduled and prepared while step N runs, its input ids taken from N's sampled tensor "
        "(engines/core/async_scheduling.py; CPU, one rank, no speculative decoding; requests with log-probs, "
        "penalties or structured output step synchronously); off: one step at a time, blocking on a full socket"))
    async_scheduling_on_accelerators: bool = field(default=False, metadata=setting(
        "async scheduling (above) on an accelerator too (CUDA, Ascend, MUSA; one rank): on accelerators: measured by "
        "the device script (tests/gpu/bench_cuda.py, its async section, docs/performance.md) and off until a run "
        "there measures it faster; the CPU schedules ahead whatever this says"))
    speculative_config: dict[str, Any] | None = field(default=None, metadata=setting(
        "speculative decoding, as vLLM spells it (JSON on the command line): "
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4} or '
        '{"method": "mtp", "num_speculative_tokens": 2} (the checkpoint\'s MTP layer: DeepSeek-V3, GLM-4.5, GLM-5); '
        "disable_by_batch_size: no drafts while more sequences run (engines/speculative/)",
        check=parse_speculative_config))
    kv_events_config: dict[str, Any] | None = field(default=None, metadata=setting(
        "publish KV-cache events for prefix-aware routers, vLLM's JSON: enable_kv_cache_events, publisher "
        "(zmq), endpoint, replay_endpoint, topic, buffer_steps, hwm, max_queue_size (engines/kv/events.py)"))
    kv_offloading_size: float | None = field(default=None, metadata=setting(
        "GiB of host memory that keeps the prefix-cache blocks the device pool evicts, reloaded on a later "
        "hit instead of recomputed (engines/kv/host_tier.py)", gt=0, le=1 << 20))
    kv_transfer_config: dict[str, Any] | None = field(default=None, metadata=setting(
        "prefill/decode disaggregation, vLLM's JSON: kv_connector (MooncakeConnector), kv_role (kv_producer, "
        "kv_consumer, kv_both), engine_id, kv_ip, kv_port (the side channel), kv_buffer_device, "
        "kv_load_failure_policy (recompute, fail), kv_connector_extra_config (protocol, device_name, "
        "hold_timeout_s, handshake_timeout_s); docs/disaggregation.md", check=parse_kv_transfer_config))
    # Which replica of its model this engine is (the worker's index in the pool; KV events carry it).
    data_parallel_rank: int = field(default=0, metadata=setting("this replica's index among its model's", ge=0))
    quantization: str | None = field(default=None, metadata=setting(
        "the weights' quantization: a quantized checkpoint's format (refused when the checkpoint is in "
        "another), or fp8 / w8a8 to quantize a float checkpoint at load (per-channel weights, per-token "
        "activations); default: what the checkpoint says", choices=QUANTIZATION_METHODS))
    kv_cache_dtype: str | None = field(default=None, metadata=setting(
        "the KV cache's storage dtype (vLLM's flag): auto (or None) = the model's dtype; bfloat16 / float16 halve a float32 "
        "model's KV bytes; int8 / fp8_e4m3 (alias fp8) store 8-bit codes with a float32 scale per token and head "
        "(kernels/kv_quant.py); attention accumulates in float32", choices=KV_CACHE_DTYPE_NAMES))
    enable_lora: bool = field(default=False, metadata=setting(
        "serve PEFT LoRA adapters on this model, each request's own or none (docs/lora.md)"))
    max_loras: int = field(default=1, metadata=setting(
        "LoRA adapters on the device at once (slots); a request whose adapter finds no slot waits", ge=1))
    max_lora_rank: int = field(default=16, metadata=setting(
        "the largest LoRA rank served; every slot is padded to it", ge=1))
    max_cpu_loras: int | None = field(default=None, metadata=setting(
        "LoRA adapters kept loaded on the host (least recently used idle ones let go); default max_loras", ge=1))
    lora_modules: dict[str, str] | None = field(default=None, metadata=setting(
        "LoRA adapters loaded at start: name -> PEFT directory"))
    runner: str | None = field(default=None, metadata=setting(
        "what the model is served for (vLLM's flag): generate (text) or pooling (embeddings, classification, "
        "scores: one prefill per input, no decode; engines/pooling/); auto: pooling for a sentence-transformers "
        "directory (modules.json), a *ForSequenceClassification or a bare *Model architecture, else generate; "
        "unset: auto",
        choices=RUNNERS))
    convert: str | None = field(default=None, metadata=setting(
        "a pooling runner's task (vLLM's flag): embed (a vector per input) or classify (label probabilities; "
        "a cross-encoder's relevance score); default: classify for a *ForSequenceClassification, else embed",
        choices=CONVERTS))
    classifier_from_token: str | None = field(default=None, metadata=setting(
        "with convert classify on a causal LM (a Qwen3-Reranker): the two tokens false,true (e.g. no,yes) whose "
        "last-token logits give the score sigmoid(logit[true] - logit[false]) (vLLM's hf_overrides "
        "classifier_from_token)"))

    def __post_init__(self) -> None:
        for f in fields(self):
            check_setting(f.name, getattr(self, f.name), f.metadata)
        if self.enforce_eager:
            self.compile = "off"
        if self.kv_events_config is not None:
            KVEventsConfig.parse(self.kv_events_config)
        if self.kv_offloading_size is not None and self.tensor_parallel_size > 1:
            raise ValueError("kv_offloading_size is not supported with tensor_parallel_size > 1 yet "
                             "(each rank holds a shard of the KV cache)")
        if self.kv_transfer_config is not None and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("kv_transfer_config is not supported with several ranks per replica yet "
                             "(each rank holds a shard of the KV cache)")
        if self.kv_transfer_config is not None and self.kv_offloading_size is not None:
            raise ValueError("kv_transfer_config and kv_offloading_size cannot be combined yet (one KV connector)")
        if self.enable_lora:
            check_lora(self)
        if self.runner == "generate" and (self.convert is not None or self.classifier_from_token is not None):
            raise ValueError("convert and classifier_from_token need runner pooling (or auto)")
        if self.classifier_from_token is not None and self.convert == "embed":
            raise ValueError("classifier_from_token scores with convert classify, not embed")
        if self.kv_offloading_size is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs enable_prefix_caching: the tier is keyed by its block hashes")

    @property
    def uses_mtp(self) -> bool:
        """Whether speculative decoding drafts with the checkpoint's MTP layer (engines/speculative/)."""
        return uses_mtp(self.speculative_config)


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
    if "check" in meta:
        meta["check"](value)


def check_lora(config: EngineConfig) -> None:
    """Refuse, by name, what LoRA adapters are not served with yet."""
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        raise ValueError(f"max_cpu_loras ({config.max_cpu_loras}) must be at least max_loras ({config.max_loras})")
    if config.pipeline_parallel_size > 1:
        raise ValueError("enable_lora is not supported with pipeline_parallel_size > 1 yet")
    if config.quantization is not None:
        raise ValueError(f"enable_lora is not supported with quantization {config.quantization!r} yet")
    if config.uses_mtp:
        raise ValueError("enable_lora is not supported with speculative method mtp yet")
