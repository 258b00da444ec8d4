"""``kv_cache_dtype`` end to end on a float32 tiny Llama: per-token log-probs (teacher-forced on the
float32-KV run's own continuation) within a stated tolerance, greedy tokens as the float32-KV run's where
that tolerance allows, the pool holding ~2x (half precision) / ~3-4x (8-bit) the blocks for the same
memory, the planner and the pool agreeing on bytes per token, and the startup log and /health info
naming the dtype and bytes per token."""

import logging
from types import SimpleNamespace

import pytest
import torch

import engines.platforms
from engines import LLM, SamplingParams
from engines.capacity import plan, pool_blocks
from server.worker import _engine_info

KINDS = ("auto", "bfloat16", "float16", "int8", "fp8_e4m3")  # auto (float32) first: the others' yardstick
# Max abs difference of a token's log-prob from the float32-KV run's, in nats (measured on this model:
# bf16 ~3e-3, fp16 ~4e-4, int8 ~6e-3, fp8 ~5e-2; the bounds leave room, a mis-applied scale costs nats).
LOGPROB_TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "int8": 5e-2, "fp8_e4m3": 0.3}
PROMPTS = [[(5 * i + 3 * k) % 250 + 3 for i in range(20 + 9 * k)] for k in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
FORCED = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
BLOCK_SIZE, FRACTION = 16, 0.5
FREE = 2 * 21 * BLOCK_SIZE * 512  # the free memory after warm-up, pinned: 20 float32 blocks of this model


class _Lines(logging.Handler):
    """Keeps the messages logged to it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    """kind -> (greedy token ids per prompt, teacher-forced log-probs per prompt, KV blocks, bytes per block,
    the startup log line, the worker's /health info)."""
    results = {}
    forced_prompts = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engines.platforms, "_host_available_bytes", lambda: FREE)
        for kind in KINDS:
            handler = _Lines()
            logging.getLogger("engines.engine").addHandler(handler)
            try:
                llm = LLM(tiny_model_dir, kv_cache_dtype=kind, block_size=BLOCK_SIZE, max_model_len=128,
                          max_num_seqs=4, kv_cache_memory_fraction=FRACTION)
            finally:
                logging.getLogger("engines.engine").removeHandler(handler)
            with llm:
                greedy = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
                if forced_prompts is None:
                    forced_prompts = [p + g for p, g in zip(PROMPTS, greedy)]
                forced = [[lp.logprob for lp in out.prompt_logprobs[1:]] for out in llm.generate(forced_prompts, FORCED)]
                engine = llm.engine
                info = _engine_info(engine, SimpleNamespace(device="cpu"), 0.0)
                results[kind] = (greedy, torch.tensor(forced), engine.block_manager.num_blocks,
                                 engine.runner.bytes_per_block(), [r for r in handler.lines if "engine ready" in r], info)
    return results


@pytest.mark.parametrize("kind", KINDS[1:])
def test_log_probs_stay_within_tolerance_of_the_float32_kv_run_and_greedy_matches(runs, kind):
    greedy, forced, *_ = runs[kind]
    exact_greedy, exact_forced, *_ = runs["auto"]
    assert (forced - exact_forced).abs().max() < LOGPROB_TOLERANCE[kind]
    assert greedy == exact_greedy


@pytest.mark.parametrize(("kind", "at_least"), [("bfloat16", 2.0), ("float16", 2.0), ("int8", 3.0), ("fp8_e4m3", 3.0)])
def test_the_pool_holds_more_blocks_for_the_same_memory(runs, kind, at_least):
    """Half precision: 2x. 8-bit: 4x less the scales (4 bytes per head of 16 here: 3.2x; 3.76x at D = 64)."""
    *_, blocks, bytes_per_block, _, _ = runs[kind]
    *_, exact_blocks, exact_bytes, _, _ = runs["auto"]
    assert exact_bytes == 2 * 2 * 2 * 16 * 4 * BLOCK_SIZE  # K and V, 2 layers, 2 KV heads, D 16, float32
    assert blocks == pool_blocks(FREE, FRACTION, bytes_per_block)
    assert (blocks + 1) / (exact_blocks + 1) >= at_least * 0.97  # +1: the scratch block


@pytest.mark.parametrize("kind", KINDS)
def test_the_planner_and_the_pool_agree_on_bytes_per_token(runs, tiny_model_dir, kind):
    *_, bytes_per_block, _, _ = runs[kind]
    planned = plan(str(tiny_model_dir), kv_cache_dtype=kind, block_size=BLOCK_SIZE)
    assert planned.kv_bytes_per_token_per_device * BLOCK_SIZE == bytes_per_block


@pytest.mark.parametrize(("kind", "stored"), [("auto", "float32"), ("int8", "int8"), ("fp8_e4m3", "float8_e4m3fn")])
def test_the_startup_log_and_health_info_name_the_kv_dtype_and_bytes_per_token(runs, kind, stored):
    *_, bytes_per_block, log, info = runs[kind]
    per_token = bytes_per_block // BLOCK_SIZE
    assert info["kv_cache_dtype"] == stored and info["kv_cache_bytes_per_token"] == per_token
    assert len(log) == 1 and f"KV cache {stored} ({per_token} bytes per token)" in log[0]


def test_a_bad_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM("/nonexistent", kv_cache_dtype="fp4")


def test_mla_refuses_an_8bit_cache_and_reads_a_half_precision_one(tiny_models):
    with pytest.raises(ValueError, match="not implemented for MLA"):
        LLM(tiny_models("deepseek_v3"), kv_cache_dtype="int8", num_kv_blocks=8)
    path = tiny_models("deepseek_v3")
    prompt = PROMPTS[1]
    with LLM(path, num_kv_blocks=16) as llm:
        exact = llm.generate([prompt], GREEDY)[0].token_ids
    with LLM(path, num_kv_blocks=16, kv_cache_dtype="float16") as llm:
        assert llm.engine.runner.kv_cache.dtype == torch.float16
        assert llm.generate([prompt], GREEDY)[0].token_ids == exact
