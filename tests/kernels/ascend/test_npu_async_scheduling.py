"""Async scheduling on an accelerator (engines/core/async_scheduling.py with ``async_scheduling_on_accelerators``),
on the fake torch_npu's Ascend platform (tests/kernels/ascend/conftest.py): decode steps replay captured
buckets while the next step is scheduled and prepared (its bucket filled from host lengths only), and greedy
tokens equal transformers' token for token, with preemption; without the setting an accelerator steps
synchronously (its default until the device script measures async faster)."""

import random

import torch
from transformers import AutoModelForCausalLM

from xinserve.engines import LLM, SamplingParams

OPTIONS = {"dtype": "float32", "block_size": 128, "num_kv_blocks": 5, "max_num_seqs": 4, "max_num_batched_tokens": 512}


def transformers_greedy(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                               top_p=None, top_k=None, temperature=None)[0, len(p):].tolist() for p in prompts]


def test_captured_decode_scheduled_ahead_equals_transformers(npu_platform, tiny_models):
    path = tiny_models("llama", hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=1)
    llm = LLM(path, device="npu:0", compile="on", async_scheduling_on_accelerators=True, **OPTIONS)
    engine = llm.engine
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.kind == "captured"
    stepper = engine.async_steps()
    assert stepper is not None
    rng = random.Random(3)
    # 5 sequences of 100-140 tokens + 40 new ones, 5 blocks of 128: at most 4 fit, so some are preempted
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(100, 140))] for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    got: dict[str, list[int]] = {}
    while stepper.has_unfinished():
        for out in stepper.step().outputs:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    stepper.close()
    assert [got[str(i)] for i in range(len(prompts))] == transformers_greedy(path, prompts, 40)
    assert stepper.overlapped > 40 and graphs.steps_run > 40  # scheduled ahead, replayed
    assert engine.stats().num_preemptions_total > 0
    assert engine.scheduler.block_manager.num_free_blocks == OPTIONS["num_kv_blocks"]  # nothing leaked


def test_an_accelerator_steps_synchronously_unless_the_setting_says(npu_platform, tiny_models):
    path = tiny_models("llama", hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=1)
    assert LLM(path, device="npu:0", compile="off", **OPTIONS).engine.async_steps() is None
