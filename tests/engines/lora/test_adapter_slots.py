"""Device slots: more adapters than ``max_loras`` run by evicting the least recently used idle slot, a
request whose adapter finds no slot waits (never fails, never takes a running request's slot), and an
adapter removed while its requests run stays with them until they finish."""

import pytest

from tests.engines.lora.conftest import PeftReference
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.lora.slot_table import SlotTable

MAX_TOKENS = 6
RANKS = {"a": 4, "b": 8, "c": 16}


@pytest.fixture(scope="module")
def setup(tiny_models, adapters):
    paths = {name: adapters("llama", rank, seed=10 + i) for i, (name, rank) in enumerate(RANKS.items())}
    return tiny_models("llama"), paths, PeftReference(tiny_models("llama"), paths, MAX_TOKENS)


def test_slot_table_reuses_then_evicts_the_least_recently_used_idle_slot():
    table = SlotTable(2)
    assert table.acquire(1) == 0 and table.acquire(2) == 1
    assert table.acquire(3) is None  # both slots' adapters run
    table.release(1)
    assert table.acquire(1) == 0  # still there: reused, no eviction
    table.release(1)
    table.release(2)
    assert table.acquire(3) == 1  # 2 was used less recently than 1: its slot goes
    assert table.acquire(2) == 0 and table.running() == [3, 2]
    table.release(3)
    table.forget(3)
    assert table.acquire(4) == 1


def test_more_adapters_than_slots_wait_for_a_slot_and_all_finish_correctly(setup):
    base, paths, reference = setup
    prompts = [[5 + i, 9, 30 + i, 41, 7] for i in range(8)]
    names = ["a", "b", "c", None, "c", "b", "a", None]
    with LLM(base, enable_lora=True, max_loras=1, max_lora_rank=16, num_kv_blocks=64, block_size=4,
             lora_modules={n: str(p) for n, p in paths.items()}) as llm:
        engine = llm.engine
        for i, (prompt, name) in enumerate(zip(prompts, names)):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, lora_name=name))
        outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        waited, slot_contents = False, set()
        while engine.has_unfinished_requests():
            result = engine.step()
            assert not result.failures
            for out in result.outputs:
                outputs[out.request_id] += out.new_token_ids
            stats = engine.stats()
            assert len(stats.running_lora_adapters) <= 1 and stats.max_lora == 1
            waited |= bool(stats.waiting_lora_adapters)
            slot_contents.add(engine.runner.lora.written[0])
        assert waited, "a request should have waited for the one slot"
        assert len(slot_contents) == 3, "the one slot held each adapter in turn"
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        assert outputs[str(i)] == reference.generate(prompt, name)


def test_remove_lora_while_its_requests_run_lets_them_finish_with_it(setup):
    base, paths, reference = setup
    prompt = [11, 12, 13, 14, 15]
    with LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64, block_size=4) as llm:
        engine = llm.engine
        engine.add_lora("a", str(paths["a"]))
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, lora_name="a"))
        tokens = [t for out in engine.step().outputs for t in out.new_token_ids]
        engine.remove_lora("a")
        assert engine.lora_names() == []
        with pytest.raises(ValueError, match="'a' is not loaded"):
            engine.add_request("s", prompt, SamplingParams(lora_name="a"))
        with pytest.raises(KeyError):
            engine.remove_lora("a")
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step().outputs for t in out.new_token_ids]
        assert tokens == reference.generate(prompt, "a")
        assert engine.runner.lora.host == {} and engine.loras.slots.slot_of == {}  # freed after it finished
        engine.add_lora("a", str(paths["b"]))  # the name again, another adapter: a new load, a new prefix root
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, lora_name="a"))
        assert out[0].outputs[0].token_ids == reference.generate(prompt, "b")


def test_lora_requests_are_refused_without_enable_lora_or_an_unknown_name(tiny_models, setup):
    base, paths, _ = setup
    with LLM(base, num_kv_blocks=16, block_size=4) as llm:
        with pytest.raises(ValueError, match="not enabled"):
            llm.engine.add_request("x", [5, 6], SamplingParams(lora_name="a"))
        with pytest.raises(ValueError, match="not enabled"):
            llm.engine.add_lora("a", str(paths["a"]))
    with LLM(base, enable_lora=True, max_lora_rank=8, num_kv_blocks=16, block_size=4,
             lora_modules={"a": str(paths["a"])}) as llm:
        with pytest.raises(ValueError, match="'nope' is not loaded"):
            llm.engine.add_request("x", [5, 6], SamplingParams(lora_name="nope"))
        with pytest.raises(ValueError, match="already loaded"):
            llm.engine.add_lora("a", str(paths["a"]))
        with pytest.raises(ValueError, match="rank 16, more than max_lora_rank 8"):
            llm.engine.add_lora("c", str(paths["c"]))
        assert llm.engine.lora_names() == ["a"] and not llm.engine.requests
