"""CPU kernels written in C++ (``kernels/cpu/csrc/``), built with ``torch.utils.cpp_extension`` on first
use (kernels/cpu/cpp_build.py): decode attention that reads the paged cache in place, the KV cache
write, and the linear layers of a decode step (a few rows: kernels/cpu/csrc/decode_linear.cpp). Importing
this module builds the extension when it is not built yet; without a C++ compiler (or ninja) that raises
ImportError, and the registry keeps the reference.

Each kernel is reachable two ways (kernels/cpu/csrc/bindings.cpp): eager calls go straight to the Python
module (a few microseconds; the GIL is released while the kernel runs), and calls traced by
torch.compile (engines/worker/graphs.py) to the torch operators the extension registers in C++, whose fake
implementations (output shapes, for the compiler) are registered here.
"""

import torch
import torch.nn.functional as F

from xinserve.kernels.cpu.cpp_build import BUILD_KEY, OPS_NAMESPACE, build
from xinserve.kernels.model_shapes import ModelShapes

_extension = build()
_ops = getattr(torch.ops, OPS_NAMESPACE)
# Up to this many rows the C++ linear beats the GEMM of torch's BLAS with the weight cold, on the AVX2
# machine measured (1.1-2.6x at 1-32 rows, the weight read from DRAM; at 64 rows MKL is level or ahead).
DECODE_ROWS = 32
LINEAR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.library.register_fake(f"{OPS_NAMESPACE}::paged_decode_attention")
def _(query, key_cache, value_cache, block_tables, seq_lens, scale):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.register_fake(f"{OPS_NAMESPACE}::write_kv")
def _(key, value, key_cache, value_cache, slot_mapping):
    return None


@torch.library.register_fake(f"{OPS_NAMESPACE}::decode_linear")
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           gather: object = None) -> torch.Tensor:
    """The reference's signature; the gather plan is not needed (nothing is gathered)."""
    if not torch.compiler.is_compiling():
        return _extension.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    return _ops.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """kernels/references/dense.py::write_kv's contract, the same bytes stored, in one pass over the tokens."""
    if not torch.compiler.is_compiling():
        _extension.write_kv(key, value, key_cache, value_cache, slot_mapping)
        return
    _ops.write_kv(key, value, key_cache, value_cache, slot_mapping)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``'s contract. Decode-sized inputs (x [M, K], M <= DECODE_ROWS, float32 / bfloat16 /
    float16, weight contiguous) run the C++ kernel, which streams the weight once at the machine's read
    bandwidth; larger ones (prefill) F.linear, whose GEMM wins there."""
    if not _decode_sized(x, weight):
        return F.linear(x, weight, bias)
    if not torch.compiler.is_compiling():
        return _extension.decode_linear(x, weight, bias)
    return _ops.decode_linear(x, weight, bias)


def _decode_sized(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] <= DECODE_ROWS and x.dtype in LINEAR_DTYPES and weight.dtype == x.dtype
            and x.device.type == "cpu" and weight.is_contiguous())


paged_decode_attention.build_key = BUILD_KEY  # a rebuilt kernel is timed again (kernels/probes/timing.py)
write_kv.build_key = BUILD_KEY
linear.build_key = BUILD_KEY


def unsupported(op: str, shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    if op == "decode_attention" and shapes.sliding_window is not None:
        return "sliding window unsupported"
    return None


OPS = {"paged_decode_attention": paged_decode_attention, "write_kv": write_kv, "linear": linear}
