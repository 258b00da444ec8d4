"""Capacity planning: what one device of a replica holds for a model under a parallel layout and a
quantization scheme, from its config alone (``xinserve plan``; nothing is loaded).

The model is built with its own classes on the meta device and sharded for rank 0 by the same
``shard_model`` the workers run, so parameter counts, per-rank shapes and the KV bytes per token
(``model.kv_bytes_per_token``, which sizes the worker's pool through ``ModelRunner.bytes_per_block``)
are the server's own; ``pool_blocks`` is the one rule both use to turn free bytes into KV blocks.

What is arithmetic here rather than the server's code: quantized weight bytes (``quantized_bytes``),
pipeline stages (contiguous layer ranges, KV per stage in proportion to its layers) and expert
parallelism (whole experts per rank: E / tp of them). Activations and decode graphs are not counted:
the server measures free memory after its warm-up step, the plan assumes the card is all weights and KV.

With ``mtp`` (speculative method ``mtp``) the checkpoint's MTP layer is attached as the loader attaches it
and split with the model, so its weights and its KV layer count per rank. Its shape comes from the
checkpoint's tensor names when the directory has weights, else from the published layout (DeepSeek-V3,
GLM-4.5 and GLM-5 ship the layer with its own ``embed_tokens`` and ``shared_head.head``).
"""

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xinserve.engines.lora.memory import lora_slot_bytes
from xinserve.engines.model_loader import _checkpoint_names, _config_dtype
from xinserve.engines.models import MODEL_REGISTRY
from xinserve.engines.models.config_check import read_model_config
from xinserve.engines.models.mtp import attach_mtp
from xinserve.engines.models.pooling_heads import model_class
from xinserve.engines.models.tensor_parallel import check_model_splits, shard_model
from xinserve.kernels.kv_quant import KV_CACHE_DTYPES, storage_dtype
from xinserve.kernels.ops import REFERENCE_OPS

QUANTIZATION_SCHEMES = ("none", "fp8", "w8a8", "w4a8", "w4a16")
SCALE_BYTES = 4  # scales are float32 in device memory (kernels/quantized_weight.py's layout)
BLOCK = 128  # fp8's square blocks; w4's groups of inputs
GIB = 1 << 30
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def pool_blocks(free_bytes: int, fraction: float, bytes_per_block: int) -> int:
    """The KV blocks a pool gets from ``free_bytes``: ``fraction`` of them, less the scratch block
    that padded decode rows write (``ModelRunner.allocate_kv_cache`` adds it back)."""
    return int(free_bytes * fraction) // bytes_per_block - 1


def quantized_bytes(shape: torch.Size, scheme: str) -> int:
    """Bytes of one linear weight [..., out, in] (a leading experts dim: each expert alike) stored as
    ``scheme``: fp8 1 byte per weight + a scale per 128 x 128 block; w8a8 1 byte + a scale per output
    channel; w4a8 / w4a16 half a byte + a scale per group of 128 inputs."""
    *lead, out, inp = shape
    count = math.prod(lead)
    if scheme == "fp8":
        per = out * inp + SCALE_BYTES * math.ceil(out / BLOCK) * math.ceil(inp / BLOCK)
    elif scheme == "w8a8":
        per = out * inp + SCALE_BYTES * out
    elif scheme in ("w4a8", "w4a16"):
        per = math.ceil(out * inp / 2) + SCALE_BYTES * out * math.ceil(inp / BLOCK)
    else:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_SCHEMES[1:])}, got {scheme!r}")
    return count * per


@dataclass(frozen=True, slots=True)
class Layout:
    """How a replica is split: ``tp`` ranks per stage, ``pp`` stages, experts whole per rank (``ep``)."""

    tp: int = 1
    pp: int = 1
    ep: bool = False

    @property
    def devices(self) -> int:
        return self.tp * self.pp


@dataclass(slots=True)
class Plan:
    model: str
    parameters: int  # the whole model's
    weight_bytes_per_device: int  # the largest over the stages
    kv_bytes_per_token_per_device: int  # the largest over the stages
    max_sequences: int  # of max_model_len tokens, over every replica
    fits: bool
    reason: str | None
    layout: Layout = field(default_factory=Layout)
    replicas: int = 1
    device_memory_bytes: int = 0
    max_model_len: int = 0
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    block_size: int = 128
    kv_blocks_per_device: int = 0  # the pool of the stage with the fewest blocks
    kv_bytes_per_token_per_replica: int = 0  # every rank's KV, as a transfer between instances moves it
    lora_bytes_per_device: int = 0  # max_loras LoRA adapter slots (engines/lora/memory.py), the largest stage's

    def sequences_of(self, tokens: int) -> int:
        """Sequences of ``tokens`` tokens the pools hold at once, over every replica."""
        return self.kv_blocks_per_device // math.ceil(tokens / self.block_size) * self.replicas

    def as_json(self) -> dict[str, Any]:
        keys = ("parameters", "weight_bytes_per_device", "lora_bytes_per_device", "kv_bytes_per_token_per_device",
                "max_sequences", "fits", "reason")
        return {key: getattr(self, key) for key in keys}


class _MetaRank:
    """Rank 0 of ``world_size`` for sharding on the meta device: nothing runs, so no collective."""

    def __init__(self, world_size: int) -> None:
        self.rank, self.world_size = 0, world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a planned model never runs")

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        raise AssertionError("a planned model never runs")


def read_config(path: str) -> tuple[Any, type[nn.Module], str]:
    """(config, our model class, "Arch at 'path'") from ``path``/config.json alone; ValueError naming
    the file (and the field) when it is missing or cannot make one of our models."""
    config = read_model_config(path)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    model_cls = model_class(MODEL_REGISTRY, architecture)  # a pooling form (Qwen3Model) too
    if model_cls is None:
        raise ValueError(f"unsupported architecture {architecture!r} in {str(Path(path) / 'config.json')!r}; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}")
    return config, model_cls, f"{architecture} at {path!r}"


def meta_model(config: Any, model_cls: type[nn.Module], dtype: torch.dtype, tp: int,
               name: str, mtp_path: str | None = None) -> tuple[nn.Module, int, dict[str, torch.Size]]:
    """(the model in ``dtype`` on the meta device as rank 0 of ``tp`` holds it, with its float32 parameters
    kept so: exactly what the loader allocates before reading weights; the whole model's parameter
    count; the whole routed experts' shapes by name). Built once: the init on meta takes seconds.
    ``mtp_path``: the checkpoint whose MTP layer is attached (``mtp_checkpoint_names``)."""
    with torch.device("meta"):
        model = model_cls(config)
        if mtp_path is not None:
            attach_mtp(model, config, REFERENCE_OPS, mtp_checkpoint_names(mtp_path, config, model), name)
        parameters = sum(p.numel() for p in model.parameters())
        experts = {key: p.shape for key, p in model.named_parameters() if ".mlp.experts." in key}
        if tp > 1:
            shard_model(model, _MetaRank(tp), name)
    model = model.to(dtype=dtype)
    model.keep_float32_parameters()
    return model, parameters, experts


def _is_quantized(name: str, param: nn.Parameter, model_cls: type[nn.Module]) -> bool:
    """Linear weights are; embeddings, the LM head, norms, biases, routers, what the model keeps in
    float32 (the DSA indexer's head weights) and its ``FLOAT_WEIGHTS`` (MLA's kv_b_proj, dequantized at
    load) stay in the unquantized dtype, as the loader keeps them (engines/quantization/install.py)."""
    if param.dim() < 2 or name.endswith((*model_cls.FLOAT32_PARAMETERS, *model_cls.FLOAT_WEIGHTS, "mlp.gate.weight")):
        return False
    return "embed_tokens" not in name and not name.startswith(("lm_head", "mtp.shared_head.head"))


def mtp_checkpoint_names(path: str, config: Any, model: nn.Module) -> set[str]:
    """The MTP layer's tensor names: the checkpoint's when ``path`` has weights, else the published layout's
    (its own embedding and head; a DSA indexer when the model has one). ``model``: built without it."""
    try:
        return _checkpoint_names(path)
    except ValueError:  # a config-only directory
        prefix = f"model.layers.{config.num_hidden_layers}."
        parts = ["eh_proj.weight", "embed_tokens.weight", "shared_head.head.weight"]
        if getattr(model.model, "has_indexer", False):
            parts.append("self_attn.indexer.wk.weight")
        return {prefix + part for part in parts}


def _stage_of(name: str, num_layers: int, pp: int) -> int:
    """The pipeline stage that holds parameter ``name``: a layer's own stage (stage s holds layers
    [s * L // pp, (s + 1) * L // pp)), the embedding and LM head the first (it samples), the final
    norm the last (engines/parallel/pipeline_parallel.py)."""
    match = _LAYER.match(name)
    if match:
        layer = int(match.group(1))
        return next(s for s in range(pp) if layer < (s + 1) * num_layers // pp)
    return 0 if "embed_tokens" in name or name.startswith("lm_head") else pp - 1


def weight_bytes_per_stage(model: nn.Module, experts: dict[str, torch.Size], model_cls: type[nn.Module],
                           layout: Layout, scheme: str) -> list[int]:
    """Bytes one device of each stage holds. ``model`` is rank 0's TP shard, ``experts`` the whole routed
    experts' shapes (expert parallel: E / tp whole experts per rank instead of every expert's slice)."""
    stages = [0] * layout.pp
    for name, param in model.named_parameters():
        shape = param.shape
        if layout.ep and ".mlp.experts." in name:
            whole = experts[name]
            shape = torch.Size([whole[0] // layout.tp, *whole[1:]])
        if scheme != "none" and _is_quantized(name, param, model_cls):
            size = quantized_bytes(shape, scheme)
        else:
            size = math.prod(shape) * param.element_size()
        stages[_stage_of(name, model.num_layers, layout.pp)] += size
    return stages


def layout_problems(config: Any, model_cls: type[nn.Module], path: str, name: str, layout: Layout) -> list[str]:
    """Why ``layout`` cannot split the model, each naming the shape that does not divide."""
    problems = []
    if layout.tp > 1:
        try:
            check_model_splits(path, layout.tp)
        except ValueError as exc:
            problems.append(str(exc).removeprefix(f"model {name}: "))
    layers = config.num_hidden_layers
    if layout.pp > layers:
        problems.append(f"pipeline_parallel_size {layout.pp} is more than its {layers} layers")
    moe = model_cls.spec(config).moe if model_cls.spec(config).moe_layers else None
    if layout.ep and moe is None:
        problems.append("expert parallel needs a mixture-of-experts model")
    elif layout.ep and moe.num_experts % layout.tp:
        problems.append(f"its {moe.num_experts} routed experts do not divide over {layout.tp} expert-parallel ranks")
    return problems


def plan(path: str, *, devices: int | None = None, device_memory_gib: float = 64.0, layout: Layout = Layout(),
         quantization: str = "none", kv_cache_dtype: str = "auto", max_model_len: int | None = None,
         dtype: torch.dtype | None = None, block_size: int = 128, kv_cache_memory_fraction: float = 0.7,
         mtp: bool = False, max_loras: int = 0, max_lora_rank: int = 16) -> Plan:
    """Plan ``path`` (a directory with config.json; weights are not read) on ``devices`` cards of
    ``device_memory_gib`` GiB each (default: one replica's tp * pp). ``mtp``: with the checkpoint's MTP
    layer loaded (speculative method ``mtp``); ``max_loras``: LoRA adapter slots of ``max_lora_rank``
    held beside the weights (enable_lora)."""
    if quantization not in QUANTIZATION_SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_SCHEMES)}, got {quantization!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    config, model_cls, name = read_config(path)
    dtype = dtype or _config_dtype(config)
    devices = devices or layout.devices
    max_model_len = max_model_len or config.max_position_embeddings
    problems = layout_problems(config, model_cls, path, name, layout)
    if devices % layout.devices:
        problems.append(f"{devices} devices do not make whole replicas of {layout.tp} x {layout.pp}")
    if max_model_len > config.max_position_embeddings:
        problems.append(f"max_model_len {max_model_len} is more than max_position_embeddings "
                        f"{config.max_position_embeddings}")
    if mtp and layout.pp > 1:
        problems.append("speculative method 'mtp' is not implemented with pipeline parallel")
    # a layout that does not split the model is counted whole (a shard would fail or be wrong)
    model, parameters, experts = meta_model(config, model_cls, dtype, 1 if problems else layout.tp, name,
                                            path if mtp else None)
    result = Plan(name, parameters, 0, 0, 0, False, None, layout,
                  max(1, devices // layout.devices), int(device_memory_gib * GIB), max_model_len, quantization,
                  kv_cache_dtype, block_size)
    if problems:
        result.reason = f"model {name}: " + "; ".join(problems)
        return result
    weights = weight_bytes_per_stage(model, experts, model_cls, layout, quantization)
    kv_token = model.kv_bytes_per_token(storage_dtype(kv_cache_dtype, dtype))  # the worker's cache spec
    layers = config.num_hidden_layers
    stage_layers = [(s + 1) * layers // layout.pp - s * layers // layout.pp for s in range(layout.pp)]
    kv_stages = [math.ceil(kv_token * n / layers) for n in stage_layers]
    slots = max_loras * lora_slot_bytes(config, max_lora_rank, dtype, layout.tp) if max_loras else 0
    lora = [math.ceil(slots * n / layers) for n in stage_layers]
    result.weight_bytes_per_device, result.kv_bytes_per_token_per_device = max(weights), max(kv_stages)
    result.lora_bytes_per_device = max(lora)
    weights = [w + slot for w, slot in zip(weights, lora, strict=True)]  # what the KV pool is sized after
    result.kv_bytes_per_token_per_replica = layout.tp * sum(kv_stages)
    result.kv_blocks_per_device = min(
        max(0, pool_blocks(result.device_memory_bytes - w, kv_cache_memory_fraction, kv * block_size))
        for w, kv in zip(weights, kv_stages))
    seqs = result.sequences_of(max_model_len) // result.replicas
    result.max_sequences = seqs * result.replicas
    heaviest = weights.index(max(weights))
    if max(weights) > result.device_memory_bytes:
        result.reason = (f"model {name}: the weights{' and LoRA slots' if slots else ''} need "
                         f"{max(weights) / GIB:.1f} GiB per device"
                         f"{f' (stage {heaviest})' if layout.pp > 1 else ''}, more than {device_memory_gib:g} GiB")
    elif seqs < 1:
        left = result.device_memory_bytes - max(weights)
        result.reason = (f"model {name}: after {max(weights) / GIB:.1f} GiB of weights, "
                         f"{kv_cache_memory_fraction:g} of the {left / GIB:.1f} GiB left holds less than one "
                         f"sequence of {max_model_len} tokens ({result.kv_bytes_per_token_per_device} bytes of KV "
                         f"per token per device)")
    result.fits = result.reason is None
    return result
