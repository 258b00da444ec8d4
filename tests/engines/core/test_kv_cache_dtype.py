"""``kv_cache_dtype`` end to end on stories260K (a trained float32 Llama, head dim 8): per-token log-probs
(teacher-forced on the float32-KV run's own continuation) within a stated tolerance, greedy tokens as the
float32-KV run's for bfloat16 / float16 (not for the 8-bit kinds: their error moves a near tie), the pool
holding 2x (half precision) / 4D / (D + 4) x (8-bit: 2.7x at D = 8, 3.8x at D = 64) the blocks for the same
memory, the planner and the pool agreeing on bytes per token, and the startup log and /health info naming
the dtype and bytes per token."""

import logging
from types import SimpleNamespace

import pytest
import torch

import xinserve.engines.platforms.cpu
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.core.capacity import plan, pool_blocks
from xinserve.server.worker.engine_worker import _engine_info

KINDS = ("auto", "bfloat16", "float16", "int8", "fp8_e4m3")  # auto (float32) first: the others' yardstick
# Max and mean abs difference of a token's log-prob from the float32-KV run's, in nats. Measured on this
# model: max / mean bf16 0.010 / 0.0018, fp16 0.0027 / 0.0003, int8 0.29 / 0.017, fp8 0.28 / 0.029; the
# bounds leave room, a mis-applied scale or a misread row costs whole nats.
LOGPROB_TOLERANCE = {"bfloat16": (0.03, 0.005), "float16": (0.01, 0.001), "int8": (0.6, 0.05),
                     "fp8_e4m3": (0.6, 0.08)}
GREEDY_IDENTICAL = ("bfloat16", "float16")
PROMPTS = [[(5 * i + 3 * k) % 250 + 3 for i in range(20 + 9 * k)] for k in range(2)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
FORCED = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
BLOCK_SIZE, FRACTION = 16, 0.5
# the free memory after warm-up, pinned: 20 float32 blocks of this model (K and V, 5 layers, 4 KV heads, D 8)
FLOAT32_TOKEN = 2 * 5 * 4 * 8 * 4
FREE = 2 * 21 * BLOCK_SIZE * FLOAT32_TOKEN


class _Lines(logging.Handler):
    """Keeps the messages logged to it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def runs(stories_dir):
    """kind -> (greedy token ids per prompt, teacher-forced log-probs per prompt, KV blocks, bytes per block,
    the startup log line, the worker's /health info)."""
    results = {}
    forced_prompts = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(xinserve.engines.platforms.cpu, "host_available_bytes", lambda: FREE)
        for kind in KINDS:
            handler, logger = _Lines(), logging.getLogger("xinserve.engines.core.engine")
            level = logger.level
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            try:
                llm = LLM(stories_dir, kv_cache_dtype=kind, block_size=BLOCK_SIZE, max_model_len=128,
                          max_num_seqs=4, kv_cache_memory_fraction=FRACTION)
            finally:
                logger.removeHandler(handler)
                logger.setLevel(level)
            with llm:
                greedy = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
                if forced_prompts is None:
                    forced_prompts = [p + g for p, g in zip(PROMPTS, greedy)]
                # every prompt's token log-probs, one after another
                forced = [lp.logprob for out in llm.generate(forced_prompts, FORCED) for lp in out.prompt_logprobs[1:]]
                engine = llm.engine
                info = _engine_info(engine, SimpleNamespace(device="cpu"), 0.0)
                results[kind] = (greedy, torch.tensor(forced), engine.block_manager.num_blocks,
                                 engine.runner.bytes_per_block(), [r for r in handler.lines if "engine ready" in r], info)
    return results


@pytest.mark.parametrize("kind", KINDS[1:])
def test_log_probs_stay_within_tolerance_of_the_float32_kv_run_and_greedy_matches(runs, kind):
    greedy, forced, *_ = runs[kind]
    exact_greedy, exact_forced, *_ = runs["auto"]
    worst, mean = LOGPROB_TOLERANCE[kind]
    assert (forced - exact_forced).abs().max() < worst and (forced - exact_forced).abs().mean() < mean
    if kind in GREEDY_IDENTICAL:
        assert greedy == exact_greedy


@pytest.mark.parametrize(("kind", "ratio"), [("bfloat16", 2.0), ("float16", 2.0), ("int8", 4 * 8 / 12),
                                             ("fp8_e4m3", 4 * 8 / 12)])
def test_the_pool_holds_more_blocks_for_the_same_memory(runs, kind, ratio):
    """Half precision: 2x. 8-bit: 4x less the scales, 4 bytes beside each head's D codes."""
    *_, blocks, bytes_per_block, _, _ = runs[kind]
    *_, exact_blocks, exact_bytes, _, _ = runs["auto"]
    assert exact_bytes == FLOAT32_TOKEN * BLOCK_SIZE and exact_bytes / bytes_per_block == pytest.approx(ratio)
    assert blocks == pool_blocks(FREE, FRACTION, bytes_per_block)
    assert (blocks + 1) / (exact_blocks + 1) == pytest.approx(ratio, rel=0.03)  # +1: the scratch block


@pytest.mark.parametrize("kind", KINDS)
def test_the_planner_and_the_pool_agree_on_bytes_per_token(runs, stories_dir, kind):
    *_, bytes_per_block, _, _ = runs[kind]
    planned = plan(str(stories_dir), kv_cache_dtype=kind, block_size=BLOCK_SIZE)
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


def test_mla_refuses_an_8bit_cache_by_name_in_the_planner_and_the_engine(tiny_models):
    path = str(tiny_models("deepseek_v3"))
    assert plan(path, kv_cache_dtype="bfloat16").kv_bytes_per_token_per_device > 0
    with pytest.raises(ValueError, match="not implemented for MLA"):
        plan(path, kv_cache_dtype="int8")


def test_chunks_preemption_and_drafts_over_an_int8_cache_give_the_one_shot_output(runs, stories_dir):
    """A token's 8-bit row depends on nothing but its own K/V, so prefill in 8-token chunks, recompute after
    preemption (12 blocks of 4 for two sequences of up to 39 tokens) and n-gram drafts whose rejected slots
    are rewritten all read back what one whole-prompt prefill wrote."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(stories_dir, kv_cache_dtype="int8", block_size=4, num_kv_blocks=12, max_num_batched_tokens=8,
             max_num_seqs=2, speculative_config=ngram) as llm:
        assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY)] == runs["int8"][0]
        assert llm.engine.scheduler.num_preemptions > 0
