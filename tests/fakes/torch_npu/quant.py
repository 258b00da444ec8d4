"""FAKE torch_npu quantization operators (see the package docstring): ``npu_quantize``,
``npu_dynamic_quant``, ``npu_trans_quant_param``, ``npu_quant_matmul``, ``npu_weight_quant_batchmatmul``,
``npu_convert_weight_to_int4pack`` and the int8 form of ``npu_grouped_matmul``. Each checks the dtype
and shape rules of the torch_npu documentation (Atlas A2 / A3 tables) and computes the documented
formula exactly on CPU tensors: integer products accumulated exactly (float64 holds them), scales
applied in float32, one rounding to the output dtype."""

import torch

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, *HALF)
INT8_MIN, INT8_MAX = -128, 127


def _check(ok: bool, op: str, detail: str) -> None:
    if not ok:
        raise RuntimeError(f"call {op} failed, error code 161002: {detail}")


def _vector(op: str, name: str, tensor: torch.Tensor, sizes: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
            ) -> None:
    _check(tensor.dim() == 1 and tensor.shape[0] in sizes, op,
           f"{name} must be 1-D of size {' or '.join(map(str, sizes))}, got {tuple(tensor.shape)}")
    _check(tensor.dtype in dtypes, op, f"{name} dtype {tensor.dtype} unsupported")


def _round_int8(values: torch.Tensor) -> torch.Tensor:
    return torch.round(values).clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    """y = round(x / scales + zero_points) (div_mode) or round(x * scales + zero_points), saturated to
    int8 (dtype torch.qint8); scales and zero_points [1] or [size of ``axis``], zero_points in the
    scales' dtype."""
    op = "aclnnAscendQuantV3"
    _check(input.dtype in FLOATS, op, f"x dtype {input.dtype} unsupported")
    _check(dtype == torch.qint8, op, f"dtype {dtype} unsupported by the fake (qint8 only)")
    channels = input.shape[axis]
    _vector(op, "scales", scales, (1, channels), FLOATS)
    _check(scales.dtype in (torch.float32, input.dtype), op, f"scales dtype {scales.dtype} with x {input.dtype}")
    if zero_points is not None:
        _vector(op, "zero_points", zero_points, (1, channels), (scales.dtype,))
    _check(axis in (-1, input.dim() - 1), op, "the fake models the last axis only")
    scaled = input.float() / scales.float() if div_mode else input.float() * scales.float()
    return _round_int8(scaled + (0 if zero_points is None else zero_points.float()))


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None):
    """Per row (token): scale = max |x| / 127, y = round(x / scale). Returns (y int8 like x, scale float32
    [x.shape[:-1]])."""
    op = "aclnnDynamicQuant"
    _check(input.dtype in HALF, op, f"x dtype {input.dtype} unsupported (float16 / bfloat16)")
    if smooth_scales is not None or group_index is not None or dst_type not in (None, torch.int8):
        raise NotImplementedError("the fake models plain int8 per-token quantisation only")
    x = input.float()
    scale = x.abs().amax(dim=-1) / INT8_MAX
    return _round_int8(x / scale.clamp(min=1e-10).unsqueeze(-1)), scale


def npu_trans_quant_param(scale, offset=None):
    """float32 scale [1] or [n] -> int64 [n]: the float32's bits in the low 32 bits."""
    op = "aclnnTransQuantParamV2"
    _check(scale.dtype == torch.float32 and scale.dim() == 1, op, f"scale must be 1-D float32, got {scale.dtype}")
    if offset is not None:
        raise NotImplementedError("the fake models npu_trans_quant_param without offset")
    return scale.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _deq_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.to(torch.int32).view(torch.float32) if scale.dtype == torch.int64 else scale.float()


# (output dtype, with per-token scales) -> (scale dtypes, bias dtypes): the documented combinations
_QUANT_MATMUL_RULES = {
    (torch.float16, False): ((torch.int64, torch.float32), (torch.int32,)),
    (torch.bfloat16, False): ((torch.float32, torch.bfloat16), (torch.int32, torch.bfloat16, torch.float32)),
    (torch.bfloat16, True): ((torch.float32, torch.bfloat16), (torch.int32, torch.bfloat16, torch.float32)),
    (torch.float16, True): ((torch.float32,), (torch.int32, torch.float16, torch.float32)),
}


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    """x1 [m, k] int8 @ x2 [k, n] int8 (int32 accumulation); an int32 bias is added to the accumulator,
    then the scale [1] / [n] (and pertoken_scale [m]), then a float bias. The int8 output and the int4
    (int32) inputs are not modelled."""
    op = "aclnnQuantMatmulV4"
    _check(x1.dtype == torch.int8 and x2.dtype == torch.int8, op,
           f"x1 / x2 must be int8 (int4 as int32 is not modelled), got {x1.dtype} / {x2.dtype}")
    _check(x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0], op,
           f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} do not multiply")
    rule = _QUANT_MATMUL_RULES.get((output_dtype, pertoken_scale is not None))
    _check(rule is not None and offset is None, op,
           f"output_dtype {output_dtype} with pertoken_scale {pertoken_scale is not None} / offset unsupported")
    m, n = x1.shape[0], x2.shape[1]
    scale_dtypes, bias_dtypes = rule
    _vector(op, "scale", scale, (1, n), scale_dtypes)
    if pertoken_scale is not None:
        _vector(op, "pertoken_scale", pertoken_scale, (m,), (torch.float32,))
    if bias is not None:
        _vector(op, "bias", bias, (n,), bias_dtypes)
    accumulator = x1.double() @ x2.double()  # exact: |sum| < 2^53
    if bias is not None and bias.dtype == torch.int32:
        accumulator = accumulator + bias.double()
    out = accumulator.float() * _deq_scale(scale)
    if pertoken_scale is not None:
        out = out * pertoken_scale[:, None]
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.float()
    return out.to(output_dtype)


def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    """[k, n] int32 holding values in -8..7 -> [k, n / 8] int32: value 8j + i of a row in bits 4i of
    word j (two's complement nibbles)."""
    op = "aclnnConvertWeightToINT4Pack"
    _check(weight.dtype == torch.int32 and weight.dim() == 2 and weight.shape[1] % 8 == 0, op,
           f"weight must be [k, n] int32 with n a multiple of 8, got {weight.dtype}{tuple(weight.shape)}")
    _check(bool(((weight >= -8) & (weight <= 7)).all()), op, "weight values must lie in -8..7")
    nibbles = (weight.to(torch.int64) & 0xF).view(weight.shape[0], -1, 8)
    words = (nibbles << (4 * torch.arange(8))).sum(dim=-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the unsigned word as a signed int32


def _unpack_int4_words(packed: torch.Tensor) -> torch.Tensor:
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF
    return (nibbles - 16 * (nibbles >= 8)).reshape(packed.shape[0], -1)


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
    """y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias, x [m, k] float16 / bfloat16,
    weight [k, n] int8 or [k, n / 8] int32 (int4 pack); scale / offset in x's dtype, [n] / [1, n] per
    channel or [ceil(k / g), n] per group of g (a multiple of 32, below k)."""
    op = "aclnnWeightQuantBatchMatmulV2"
    _check(x.dtype in HALF and x.dim() == 2, op, f"x must be 2-D float16 / bfloat16, got {x.dtype}")
    _check(weight.dtype in (torch.int8, torch.int32) and weight.dim() == 2 and weight.shape[0] == x.shape[1], op,
           f"weight must be [{x.shape[1]}, n] int8 / int32, got {weight.dtype}{tuple(weight.shape)}")
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError("the fake models floating-point outputs only")
    values = weight.to(torch.int64) if weight.dtype == torch.int8 else _unpack_int4_words(weight)
    k, n = values.shape
    _check(antiquant_scale.dtype == x.dtype, op, f"antiquant_scale dtype {antiquant_scale.dtype} differs from x's")
    if antiquant_group_size:
        _check(antiquant_group_size % 32 == 0 and 32 <= antiquant_group_size < k, op,
               f"antiquant_group_size {antiquant_group_size} must be a multiple of 32 in [32, k)")
        grid = (-(-k // antiquant_group_size), n)
    else:
        grid = (n,)
    _check(tuple(antiquant_scale.shape) in (grid, (1, n)) and (antiquant_group_size or antiquant_scale.numel() == n),
           op, f"antiquant_scale shape {tuple(antiquant_scale.shape)}, expected {grid}")
    if antiquant_offset is not None:
        _check(antiquant_offset.shape == antiquant_scale.shape and antiquant_offset.dtype == x.dtype, op,
               "antiquant_offset must match antiquant_scale's shape and x's dtype")
    if bias is not None:
        _check(bias.dtype == (torch.float16 if x.dtype == torch.float16 else torch.float32), op,
               f"bias dtype {bias.dtype} with x {x.dtype}")

    def expand(t: torch.Tensor) -> torch.Tensor:  # -> [k, n]
        t = t.float().reshape(-1, n)
        return t.repeat_interleave(antiquant_group_size, 0)[:k] if antiquant_group_size else t

    w = values.float() + (0 if antiquant_offset is None else expand(antiquant_offset))
    out = x.float() @ (w * expand(antiquant_scale))
    return (out if bias is None else out + bias.float()).to(x.dtype)


def grouped_matmul_int8(a, w, scale, per_token_scale, ends, output_dtype):
    """The int8 form of npu_grouped_matmul: x [M, K] int8, weight [E, K, N] int8, scale [E, N] (float32,
    or bfloat16 for a bfloat16 output), per_token_scale [M] float32: rows of group g give
    (x @ weight[g]) * scale[g] * per_token_scale, in output_dtype (float16 / bfloat16)."""
    op = "aclnnGroupedMatmulV4"
    _check(a.dtype == torch.int8 and w.dtype == torch.int8 and w.dim() == 3 and a.shape[1] == w.shape[1], op,
           f"quantised x / weight must be int8 [M, K] / [E, K, N], got {a.dtype}{tuple(a.shape)} "
           f"{w.dtype}{tuple(w.shape)}")
    _check(output_dtype in HALF, op, f"output_dtype {output_dtype} unsupported with int8 inputs")
    experts, _, n = w.shape
    allowed = (torch.float32, torch.bfloat16) if output_dtype == torch.bfloat16 else (torch.float32,)
    _check(scale.shape == (experts, n) and scale.dtype in allowed, op,
           f"scale must be [{experts}, {n}] {allowed}, got {scale.dtype}{tuple(scale.shape)}")
    _check(per_token_scale.shape == (a.shape[0],) and per_token_scale.dtype == torch.float32, op,
           "per_token_scale must be [M] float32")
    out, start = torch.empty(a.shape[0], n, dtype=output_dtype), 0
    for expert, end in enumerate(ends):
        rows = (a[start:end].double() @ w[expert].double()).float()
        out[start:end] = (rows * scale[expert].float() * per_token_scale[start:end, None]).to(output_dtype)
        start = end
    return out
