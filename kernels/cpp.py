"""CPU kernels written in C++ (``kernels/csrc/``), built with ``torch.utils.cpp_extension`` on first
use (kernels/cpp_build.py): decode attention that reads the paged cache in place. Importing this
module builds the extension when it is not built yet; without a C++ compiler (or ninja) that raises
ImportError, and the registry keeps the reference.
"""

import torch

from kernels.cpp_build import BUILD_KEY, build
from kernels.model_shapes import ModelShapes

_extension = build()


# Registered with torch.library so torch.compile (engines/graphs.py) can trace a decode forward that
# calls it: the fake implementation tells the compiler the output's shape without running the kernel.
@torch.library.custom_op(f"xinserve::paged_decode_attention_{BUILD_KEY}", mutates_args=())
def _paged_decode_op(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return _extension.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)


@_paged_decode_op.register_fake
def _(query, key_cache, value_cache, block_tables, seq_lens, scale):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           gather: object = None) -> torch.Tensor:
    """The reference's signature; the gather plan is not needed (nothing is gathered). Eager calls
    skip the custom op's dispatch (tens of microseconds per layer); a traced one goes through it."""
    if not torch.compiler.is_compiling():
        return _extension.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    return _paged_decode_op(query, key_cache, value_cache, block_tables, seq_lens, scale)


paged_decode_attention.build_key = BUILD_KEY  # a rebuilt kernel is timed again (kernels/timing.py)


def unsupported(op: str, shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    if shapes.sliding_window is not None:
        return "sliding window unsupported"
    return None


OPS = {"paged_decode_attention": paged_decode_attention}
