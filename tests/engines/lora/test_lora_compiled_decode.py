"""Compiled decode with adapters (CPU, torch.compile): the step's row slots live in one static buffer the
layers read (engines/lora/device_adapters.py), so a decode bucket compiled once serves any mix of adapters
and base rows, and its greedy tokens equal transformers + PEFT."""

import pytest

import xinserve.engines.worker.graphs
from tests.engines.lora.conftest import PeftReference, make_adapter
from tests.engines.worker.test_decode_graphs import compiled_engine
from xinserve.engines import SamplingParams

BUCKETS = [4]  # one compile (seconds of inductor); batches of 1 and 4 both run in it
MAX_TOKENS = 6


@pytest.mark.slow
def test_compiled_buckets_decode_mixed_adapters_like_peft(tiny_models, tmp_path):
    base = tiny_models("llama", num_layers=1, max_position_embeddings=64)
    paths = {"a": make_adapter(base, tmp_path / "a", 4, seed=30), "b": make_adapter(base, tmp_path / "b", 8, seed=31)}
    reference = PeftReference(base, paths, MAX_TOKENS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(xinserve.engines.worker.graphs, "bucket_sizes", lambda max_rows: BUCKETS)
        llm = compiled_engine(base, compile="on", enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4,
                              num_kv_blocks=40, max_num_seqs=4, max_model_len=64,
                              lora_modules={n: str(p) for n, p in paths.items()})
    with llm:
        graphs = llm.engine.runner.decode_graphs
        assert sorted(graphs.steps) == BUCKETS
        prompts = [[5, 9, 13, 17, 21], [6, 10, 14], [7, 11, 15, 19], [8, 12]]
        for names in (["a", None, "b", "a"], [None], ["b"]):
            batch = prompts[: len(names)]
            before = graphs.steps_run
            results = llm.generate(batch, [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, lora_name=n)
                                           for n in names])
            for prompt, name, result in zip(batch, names, results):
                assert result.outputs[0].token_ids == reference.generate(prompt, name), f"adapter {name} diverged"
            assert graphs.steps_run - before >= MAX_TOKENS - 1  # the decode steps ran compiled
