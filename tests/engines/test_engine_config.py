"""EngineConfig: every field is explained, and a bad value is a ValueError naming the field."""

from dataclasses import fields

import pytest

from xinserve.engines import EngineConfig
from xinserve.engines.config import KV_CACHE_DTYPE_NAMES
from xinserve.kernels.kv_quant import KV_CACHE_DTYPES


def test_every_field_has_help_text():
    assert all(f.metadata.get("help") for f in fields(EngineConfig))


@pytest.mark.parametrize(("options", "message"), [
    ({"max_num_seqs": 0}, "max_num_seqs must be at least 1, got 0"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be at least 1, got 0"),
    ({"kv_cache_memory_fraction": 0}, r"kv_cache_memory_fraction must be in \(0, 1\], got 0"),
    ({"kv_cache_memory_fraction": 1.5}, r"kv_cache_memory_fraction must be in \(0, 1\], got 1.5"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be at least 1, got 0"),
    ({"num_kv_blocks": 0}, "num_kv_blocks must be at least 1, got 0"),
    ({"compile": "fast"}, "compile must be one of auto, off, on, got 'fast'"),
    # Checked by the YAML config only, before the bounds moved onto the fields.
    ({"dtype": "fp8"}, "dtype must be one of auto, float32, float16, bfloat16, got 'fp8'"),
    ({"max_model_len": 0}, "max_model_len must be at least 1, got 0"),
    ({"block_size": 0}, "block_size must be at least 1, got 0"),
])
def test_bad_values_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **options)


def test_bounds_are_inclusive_where_they_say_so():
    config = EngineConfig(model="m", kv_cache_memory_fraction=1, max_num_seqs=1, dtype="auto", block_size=1)
    assert (config.kv_cache_memory_fraction, config.max_num_seqs, config.dtype) == (1, 1, "auto")


def test_kv_cache_dtype_choices_are_the_kernels_dtypes():
    # engines/config.py names them without importing torch; kernels/kv_quant.py maps them to storage dtypes.
    assert KV_CACHE_DTYPE_NAMES == tuple(KV_CACHE_DTYPES)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="m", kv_cache_memory_fraction=0.5, kv_cache_dtype="fp16")


@pytest.mark.parametrize(("options", "mode"), [
    ({"enforce_eager": True}, "off"),
    ({"compile": "on", "enforce_eager": True}, "off"),  # the alias wins, as vLLM's flag does
    ({"compile": "on"}, "on"),
    ({}, None),  # unset: $XINSERVE_COMPILE, else auto (engines/worker/graphs.py)
])
def test_enforce_eager_is_vllms_alias_mapped_onto_compile(options, mode):
    # ``compile`` is the one setting the engine reads; ``enforce_eager`` only sets it.
    assert EngineConfig(model="m", **options).compile == mode
