"""Build a model from a Hugging Face directory: config.json plus *.safetensors (sharded or not)."""

import glob
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import PretrainedConfig

from xinserve.engines.models import MODEL_REGISTRY
from xinserve.engines.models.config_check import read_model_config, unsupported_config_fields
from xinserve.engines.models.expert_parallel import make_exchange, place_experts
from xinserve.engines.models.mtp import attach_mtp, mtp_parameter_name
from xinserve.engines.models.pooling_heads import bare_decoder, model_class
from xinserve.engines.models.tensor_parallel import (
    Collectives,
    check_tensor_parallel,
    read_shard,
    shard_model,
)
from xinserve.engines.quantization.install import load_quantized, quant_shapes, swap_quantized_modules
from xinserve.engines.quantization.reader import checkpoint_reader
from xinserve.engines.quantization.sharding import keeps, read_rank_part
from xinserve.kernels.cpu.huge_pages import weights_on_huge_pages
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.ops import REFERENCE_OPS, KernelOps

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(dtype: str | None) -> torch.dtype | None:
    """A ``dtype`` setting's torch dtype; None for unset or "auto" (the checkpoint's)."""
    if dtype is None or dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {sorted(DTYPES)} or auto")
    return DTYPES[dtype]


def load_model(
    path: str,
    dtype: torch.dtype | None,
    device: torch.device,
    choose_ops: Callable[[ModelShapes, torch.dtype], KernelOps] | None = None,
    group: Collectives | None = None,
    expert_parallel: bool = False,
    pipeline: Any | None = None,
    quantization: str | None = None,
    choose_ep_exchange: Callable[[ModelShapes, torch.dtype], str] | None = None,
    mtp: bool = False,
    convert: str | None = None,
) -> tuple[nn.Module, PretrainedConfig]:
    """Load the model at ``path`` onto ``device`` in ``dtype`` (None: the config's dtype, else
    float32), in eval mode without gradients. ``choose_ops`` picks the kernels for the model's
    shapes and dtype (the worker's kernel registry); None: the reference kernels. Raises
    ValueError for an unsupported architecture, config field, dtype or quantization scheme and for
    missing or mismatched weights. ``group``: this rank's tensor-parallel group; ``expert_parallel``:
    its routed experts are placed whole over the group (engines/models/expert_parallel.py) instead of
    split. ``pipeline``: this rank's ``xinserve.engines.parallel.pipeline_parallel.PipelineStage``, which keeps only its
    layers. A quantized checkpoint's weights stay quantized (engines/quantization/); ``quantization``
    forces a scheme (``EngineConfig.quantization``). ``choose_ep_exchange`` names expert parallel's token
    exchange for the shapes and dtype (kernels/ep_dispatch.py); None: the all-to-all reference."""
    config = read_model_config(path)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    model_cls = model_class(MODEL_REGISTRY, architecture)
    if model_cls is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    problems = unsupported_config_fields(config)
    if problems:
        raise ValueError(f"{architecture} at {path!r} sets config fields that change the model's math and are "
                         f"not implemented, so it cannot be computed exactly: {'; '.join(problems)}")
    dtype = dtype or _config_dtype(config)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; supported: float32, float16, bfloat16")
    if convert == "embed" and architecture in MODEL_REGISTRY:
        model_cls = bare_decoder(model_cls)
    shapes = model_cls.kernel_shapes(config)
    name = f"{architecture} at {path!r}"
    reader = checkpoint_reader(path, config, quantization, model_cls.FLOAT_WEIGHTS)
    if mtp and pipeline is not None:
        raise ValueError(f"{name}: speculative method 'mtp' is not implemented with pipeline parallel: the MTP "
                         "layer needs the last stage's final hidden state and stage 0's embedding and LM head for "
                         "every draft (a stage-to-stage round trip per draft); use tensor / expert parallel, or "
                         "method 'ngram'")
    # The MTP layer's checkpoint names read as ``mtp.*`` from the start, so that the split, the quantized
    # records' cuts and the loading treat it as one more layer of the model (engines/models/mtp.py).
    mtp_names = _checkpoint_names(path) if mtp else None
    rename = partial(mtp_parameter_name, num_layers=config.num_hidden_layers) if mtp else None
    if group is not None:
        check_tensor_parallel(config, group.world_size, name)
        shapes = local_shapes(shapes, group.world_size)
        if expert_parallel:  # whole experts: the routed ones keep their full intermediate size
            shapes = replace(shapes, moe_intermediate_size=model_cls.kernel_shapes(config).moe_intermediate_size)
    build = partial(_build_on_meta, model_cls, config, name, group, expert_parallel, pipeline, mtp_names)
    weights, records = None, []
    if reader is not None:
        # The kernels are chosen for the quantized shapes, which only the records say: the checkpoint
        # is read through its reader first, each record cut to this rank's part as it arrives (by the
        # model split on the meta device with the reference kernels), then the model built.
        layout = None if group is None and pipeline is None else build(REFERENCE_OPS, None)
        keep = None if layout is None else partial(_keeps_renamed, layout, rename)
        # The reader sees the checkpoint's names (a format's description lists them); its records are renamed.
        entries = reader[1](_iter_safetensors(path, keep=keep))
        if rename is not None:
            entries = ((rename(key) or key, value) for key, value in entries)
        weights, records = read_rank_part(layout, model_cls, entries, name)
        local_experts = shapes.num_experts // (group.world_size if group is not None and expert_parallel else 1)
        shapes = replace(shapes, quant_shapes=quant_shapes(records, local_experts))
    ops = REFERENCE_OPS if choose_ops is None else choose_ops(shapes, dtype)
    exchange = None
    if group is not None and expert_parallel and shapes.num_experts and choose_ep_exchange is not None:
        exchange = make_exchange(choose_ep_exchange(shapes, dtype), group, shapes.num_experts)  # collective
    model = build(ops, exchange)
    with torch.device("meta"):
        swap_quantized_modules(model, (key for key, _ in records), ops)
    model = model.to(dtype=dtype)
    model.keep_float32_parameters()
    model = model.to_empty(device=torch.device(device))
    weights_on_huge_pages(model)  # CPU weights: one arena on huge pages (kernels/cpu/huge_pages.py); filled next
    read = None if group is None and pipeline is None else partial(read_shard, model)
    weights = weights if weights is not None else _iter_safetensors(path, read, rename=rename)
    model.load_weights(weights)
    load_quantized(model, records, torch.device(device), dtype)
    model.reset_buffers()
    model.eval().requires_grad_(False)
    return model, config


def _build_on_meta(model_cls: type, config: PretrainedConfig, name: str, group: Collectives | None,
                   expert_parallel: bool, pipeline: Any | None, mtp_names: set[str] | None, ops: KernelOps,
                   exchange: Any) -> nn.Module:
    """The model on the meta device, split for this rank: no random init, no memory. ``mtp_names``: the
    checkpoint's tensor names when its MTP layer is attached (before the split, which splits it too)."""
    with torch.device("meta"):
        model = model_cls(config, ops)
        if mtp_names is not None:
            attach_mtp(model, config, ops, mtp_names, name)
        if group is not None:
            shard_model(model, group, name, expert_parallel)
        if group is not None and expert_parallel:
            place_experts(model, group, name, exchange=exchange)
        if pipeline is not None:
            pipeline.install(model, name)
    return model


def _keeps_renamed(layout: nn.Module, rename: Callable[[str], str | None] | None, name: str) -> bool:
    return keeps(layout, name if rename is None else rename(name) or name)


def _config_dtype(config: PretrainedConfig) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32


def local_shapes(shapes: ModelShapes, tp: int) -> ModelShapes:
    """The shapes one rank's kernels see when the model is split over ``tp`` ranks."""
    return replace(
        shapes, num_heads=shapes.num_heads // tp, num_kv_heads=max(1, shapes.num_kv_heads // tp),
        intermediate_size=shapes.intermediate_size // tp, vocab_size=-(-shapes.vocab_size // tp),
        moe_intermediate_size=shapes.moe_intermediate_size // tp,
    )


def _checkpoint_names(path: str) -> set[str]:
    """Every tensor name of the checkpoint at ``path``, without reading a tensor."""
    names: set[str] = set()
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def _safetensors_files(path: str) -> list[str]:
    """The checkpoint's shard files; the index file names them when present."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights found in {path!r}")
    return files


def _iter_safetensors(
    path: str, read: Callable[[str, Any], torch.Tensor] | None = None, keep: Callable[[str], bool] | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) over every shard, on the host; the index file names the shards when present.
    ``read(name, slice)`` reads only a part of a tensor (a tensor-parallel rank's shard); ``keep(name)``
    False: the tensor is not read at all (another stage's or expert-parallel rank's). ``rename(name)``:
    the name ``read``, ``keep`` and the caller see instead (None: the name unchanged)."""
    files = _safetensors_files(path)
    # Progress on stderr, one tick per shard: a 9B checkpoint takes a while to read.
    for file in tqdm(files, desc=f"loading {os.path.basename(os.path.normpath(path))}", unit="shard",
                     disable=len(files) < 2):
        with safe_open(file, framework="pt", device="cpu") as f:
            names = f.keys()  # the handle itself is not iterable
            for stored in names:
                name = stored if rename is None else rename(stored) or stored
                if keep is None or keep(name):
                    yield name, f.get_tensor(stored) if read is None else read(name, f.get_slice(stored))
