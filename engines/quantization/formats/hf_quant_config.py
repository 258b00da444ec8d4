"""The ``quantization_config`` a Hugging Face checkpoint declares, and the per-module tensor grouping
the GPTQ and AWQ readers share."""

import json
import os
from collections.abc import Iterable, Iterator

import torch

from xinserve.engines.quantization.config import quant_config


def quantization_config(path: str, config: object) -> dict:
    """config.json's ``quantization_config``, else AutoGPTQ's older ``quantize_config.json`` next to it;
    {} when neither exists."""
    found = quant_config(config)
    legacy = os.path.join(path, "quantize_config.json")
    if not found and os.path.isfile(legacy):
        with open(legacy) as f:
            found = json.load(f)
    return dict(found)


def by_module(tensors: Iterable[tuple[str, torch.Tensor]], parts: frozenset[str], required: frozenset[str]
              ) -> Iterator[tuple[str, torch.Tensor | dict[str, torch.Tensor]]]:
    """Tensors named ``<module>.<part>`` with part in ``parts`` are gathered per module, which is
    yielded as (module, {part: tensor}) once every ``required`` part has arrived (shards come in any
    order); an optional part arriving after that is not needed and dropped. Every other tensor passes
    through as (name, tensor). Raises ValueError naming a module whose required parts never all
    arrive."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    for name, tensor in tensors:
        module, _, part = name.rpartition(".")
        if part not in parts:
            yield name, tensor
            continue
        if module in done:
            continue
        got = pending.setdefault(module, {})
        got[part] = tensor
        if required <= got.keys():
            done.add(module)
            yield module, pending.pop(module)
    for module, got in pending.items():
        raise ValueError(f"{module}: quantized weight incomplete, missing {sorted(required - got.keys())}")
