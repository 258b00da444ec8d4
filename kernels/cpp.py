"""CPU kernels written in C++ (``kernels/csrc/``), built with ``torch.utils.cpp_extension`` on first
use (kernels/cpp_build.py): decode attention that reads the paged cache in place, and the KV cache
write. Importing this module builds the extension when it is not built yet; without a C++ compiler
(or ninja) that raises ImportError, and the registry keeps the reference.

Each kernel is reachable two ways (kernels/csrc/bindings.cpp): eager calls go straight to the Python
module (a few microseconds; the GIL is released while the kernel runs), and calls traced by
torch.compile (engines/graphs.py) to the torch operators the extension registers in C++, whose fake
implementations (output shapes, for the compiler) are registered here.
"""

import torch

from kernels.cpp_build import BUILD_KEY, OPS_NAMESPACE, build
from kernels.model_shapes import ModelShapes

_extension = build()
_ops = getattr(torch.ops, OPS_NAMESPACE)


@torch.library.register_fake(f"{OPS_NAMESPACE}::paged_decode_attention")
def _(query, key_cache, value_cache, block_tables, seq_lens, scale):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.register_fake(f"{OPS_NAMESPACE}::write_kv")
def _(key, value, key_cache, value_cache, slot_mapping):
    return None


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           gather: object = None) -> torch.Tensor:
    """The reference's signature; the gather plan is not needed (nothing is gathered)."""
    if not torch.compiler.is_compiling():
        return _extension.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    return _ops.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """kernels/reference.py::write_kv's contract, the same bytes stored, in one pass over the tokens."""
    if not torch.compiler.is_compiling():
        _extension.write_kv(key, value, key_cache, value_cache, slot_mapping)
        return
    _ops.write_kv(key, value, key_cache, value_cache, slot_mapping)


paged_decode_attention.build_key = BUILD_KEY  # a rebuilt kernel is timed again (kernels/timing.py)
write_kv.build_key = BUILD_KEY


def unsupported(op: str, shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    if op == "decode_attention" and shapes.sliding_window is not None:
        return "sliding window unsupported"
    return None


OPS = {"paged_decode_attention": paged_decode_attention, "write_kv": write_kv}
