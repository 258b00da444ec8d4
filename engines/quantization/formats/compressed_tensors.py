"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, what llm-compressor writes).

The config's ``config_groups`` each give a weight scheme and optionally an activation scheme, for the
modules their ``targets`` name (``"Linear"``, an exact module name or a ``"re:"`` regex; a name or regex
match wins over the class). Modules in ``ignore`` are stored in floats and pass through as they are.
Per quantized module the checkpoint holds, by the group's ``format``:

- ``int-quantized`` / ``naive-quantized``: ``weight`` int8, ``weight_scale`` (and ``weight_zero_point``
  when asymmetric);
- ``float-quantized``: ``weight`` float8_e4m3fn, ``weight_scale``;
- ``pack-quantized``: ``weight_packed`` int32 (the signed values packed densely, 32 / bits per word),
  ``weight_shape`` [out, in], ``weight_scale``, and a ``weight_zero_point`` packed along the output dim;

plus ``input_scale`` / ``input_zero_point`` for static activations. W = (q - zero_point) * scale, the
scale per tensor, channel, group of ``group_size`` inputs or block of ``block_structure``. Activations:
none, per-token dynamic (int8 or fp8), or per-tensor static. Anything else is refused by name.
"""

import re
from collections.abc import Iterator
from typing import Any

import torch

from xinserve.engines.quantization.config import quant_config, quant_method
from xinserve.kernels.quantized_weight import Activation, QuantizedWeight, pack_int4

FORMATS = ("int-quantized", "naive-quantized", "float-quantized", "pack-quantized")
QUANT_LEAVES = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "input_scale",
                "input_zero_point")


def detect(path: str, config: Any) -> bool:
    return quant_method(config) == "compressed-tensors"


def read(path: str, config: Any, tensors: Iterator[tuple[str, torch.Tensor]]
         ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    settings = quant_config(config)
    groups = [_Group(name, group, settings.get("format")) for name, group in settings.get("config_groups", {}).items()]
    pending: dict[str, dict[str, torch.Tensor]] = {}  # module -> its quantized tensors so far
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight_g_idx":
            raise ValueError(f"compressed-tensors {name!r}: activation-ordered groups (g_idx) are not implemented")
        quantized_weight = leaf == "weight" and tensor.dtype in (torch.int8, torch.float8_e4m3fn)
        if not (quantized_weight or leaf in QUANT_LEAVES):
            yield name, tensor
            continue
        held = pending.setdefault(module, {})
        held[leaf] = tensor
        group = _group_of(module, groups)
        if group.complete(held):
            del pending[module]
            yield f"{module}.weight", group.record(held)
    if pending:
        module = min(pending)
        raise ValueError(f"compressed-tensors checkpoint: {len(pending)} modules lack quantized tensors, e.g. "
                         f"{module!r} has only {sorted(pending[module])}")


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith(f".{target}")


def _group_of(module: str, groups: list["_Group"]) -> "_Group":
    """The config group whose targets name the module (exactly or by regex), else one targeting Linear."""
    for group in groups:
        if any(_matches(t, module) for t in group.targets if t != "Linear"):
            return group
    for group in groups:
        if "Linear" in group.targets:
            return group
    raise ValueError(f"compressed-tensors: module {module!r} holds quantized tensors but no config group targets it")


class _Group:
    """One config group: what its modules' tensors are and how they become a record."""

    def __init__(self, name: str, group: dict[str, Any], default_format: str | None) -> None:
        self.targets = group.get("targets", [])
        self.format = group.get("format") or default_format
        if self.format not in FORMATS:
            raise ValueError(f"compressed-tensors format {self.format!r} ({name}) is not implemented "
                             f"(implemented: {', '.join(FORMATS)})")
        weights = group.get("weights") or {}
        self.bits, self.type = weights.get("num_bits"), weights.get("type", "int")
        self.symmetric = weights.get("symmetric", True)
        self.strategy, self.group_size = weights.get("strategy"), weights.get("group_size")
        self.block_structure = weights.get("block_structure")
        scheme = (self.type, self.bits)
        if scheme not in (("int", 8), ("int", 4), ("float", 8)) or self.strategy not in (
                "tensor", "channel", "group", "block") or weights.get("actorder") not in (None, "static"):
            raise ValueError(f"compressed-tensors weights {self.type}{self.bits} with strategy {self.strategy!r} "
                             f"(actorder {weights.get('actorder')!r}, {name}) are not implemented")
        self.activation, self.static_zero = _activation(group.get("input_activations"), name)

    def complete(self, held: dict[str, torch.Tensor]) -> bool:
        needed = ["weight_scale", "weight_packed" if self.format == "pack-quantized" else "weight"]
        if self.format == "pack-quantized":
            needed.append("weight_shape")
        if not self.symmetric:
            needed.append("weight_zero_point")
        if self.activation in ("int8_static", "fp8_static"):
            needed.append("input_scale")
            if self.static_zero:
                needed.append("input_zero_point")
        return all(leaf in held for leaf in needed)

    def record(self, held: dict[str, torch.Tensor]) -> QuantizedWeight:
        # Imported here, not at the top: compressed_tensors pulls in accelerate and transformers'
        # distributed stack (seconds per process), and every engine imports this module.
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        if self.format == "pack-quantized":
            rows, cols = (int(v) for v in held["weight_shape"])
            values = unpack_from_int32(held["weight_packed"], self.bits, torch.Size((rows, cols)))  # int8 [out, in]
        else:
            values = held["weight"]
            rows, cols = values.shape
        block = {"tensor": (rows, cols), "channel": (1, cols), "group": (1, self.group_size or cols),
                 "block": tuple(self.block_structure or (rows, cols))}[self.strategy]
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        scale = held["weight_scale"].float().reshape(grid)
        zero = None
        if not self.symmetric:
            zero = held["weight_zero_point"]
            if self.format == "pack-quantized" and zero.dtype == torch.int32:
                zero = unpack_from_int32(zero, self.bits, torch.Size(grid), packed_dim=0)
            zero = zero.float().reshape(grid)
        qweight = pack_int4(values) if self.bits == 4 else values
        static = self.activation in ("int8_static", "fp8_static")
        return QuantizedWeight(
            qweight, self.bits, scale, block, cols, rows, zero=zero, activation=self.activation,
            input_scale=held["input_scale"].float().reshape(()) if static else None,
            input_offset=held["input_zero_point"].float().reshape(()) if static and self.static_zero else None,
        )


def _activation(args: dict[str, Any] | None, name: str) -> tuple[Activation, bool]:
    """(the activation kind, whether a static one has a zero point) of a group's input_activations."""
    if not args:
        return "none", False
    kind = (args.get("type", "int"), args.get("num_bits"), args.get("strategy"), bool(args.get("dynamic")))
    known: dict[tuple, Activation] = {
        ("int", 8, "token", True): "int8_per_token", ("float", 8, "token", True): "fp8_per_token",
        ("int", 8, "tensor", False): "int8_static", ("float", 8, "tensor", False): "fp8_static",
    }
    if kind not in known:
        raise ValueError(f"compressed-tensors input_activations {kind[0]}{kind[1]} strategy {kind[2]!r} "
                         f"dynamic={kind[3]} ({name}) are not implemented")
    return known[kind], not args.get("symmetric", True)
