"""Graph-captured decode on Ascend (engines/worker/graphs.py), on the fake torch_npu whose NPUGraph records
the operators a capture runs and replays them (tests/fakes/torch_npu/npu.py): captured decode
equals eager decode token for token across bucket boundaries, with preemption and prefix caching,
and the paged attention's host context lengths are updated before every replay."""

import random
from dataclasses import replace

import torch

import xinserve.engines.core.engine
from xinserve.engines import LLM, SamplingParams

BS = 128  # Ascend's paged kernels want 128


def test_the_fake_graph_replays_what_it_captured_on_new_inputs(npu):
    x = torch.zeros(4)
    out = torch.zeros(4)
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph, pool=torch.npu.graph_pool_handle()):
        out.copy_(x * 2 + 1)
    assert graph.ops and torch.equal(out, torch.ones(4))
    x.copy_(torch.arange(4.0))
    graph.replay()
    assert torch.equal(out, torch.arange(4.0) * 2 + 1)


def prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    """Prompts of 131-140 tokens sharing a 129-token prefix (one whole block of 128 cached)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(129)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 11))] for _ in range(count)]


def test_captured_decode_equals_eager_across_buckets_with_preemption_and_prefix_caching(npu_platform, tiny_models):
    model = tiny_models("llama", hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=1)
    # 7 blocks for up to 9 sequences of 2 blocks each (the first shared): the largest batches preempt.
    options = {"dtype": "bfloat16", "block_size": BS, "num_kv_blocks": 7, "max_num_seqs": 9,
               "max_num_batched_tokens": 512}
    captured = LLM(model, device="npu:0", compile="on", **options)
    eager = LLM(model, device="npu:0", compile="off", **options)
    graphs = captured.engine.runner.decode_graphs
    assert graphs is not None and graphs.kind == "captured" and sorted(graphs.steps) == [1, 2, 4, 8, 9]
    assert eager.engine.runner.decode_graphs is None
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    vocab = captured.engine.vocab_size
    for seed, count in enumerate((1, 3, 8, 9)):
        batch = prompts(vocab, count, seed)
        got = [r.token_ids for r in captured.generate(batch, params)]
        want = [r.token_ids for r in eager.generate(batch, params)]
        assert got == want, f"batch of {count}"
    stats = captured.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total >= BS
    assert stats == eager.engine.stats()  # the same schedule on both paths
    assert graphs.steps_run > 50


def test_without_the_task_updates_a_replay_would_use_the_captured_lengths(npu_platform, tiny_models, monkeypatch):
    """What the updates are for: the fake freezes the host lengths a capture read, as a real graph
    does, so replaying without re-issuing the paged attention gives other tokens."""
    model = tiny_models("llama", hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=1)
    options = {"dtype": "bfloat16", "block_size": BS, "num_kv_blocks": 8, "max_num_seqs": 4}
    monkeypatch.setattr(npu_platform, "update_graph_tasks", lambda tasks, stream: None)
    frozen = LLM(model, device="npu:0", compile="on", **options)
    eager = LLM(model, device="npu:0", compile="off", **options)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batch = prompts(frozen.engine.vocab_size, 3, seed=5)
    assert [r.token_ids for r in frozen.generate(batch, params)] != [r.token_ids for r in eager.generate(batch, params)]


def test_the_kv_pool_is_sized_with_a_captured_graph_held(npu_platform, tiny_models, monkeypatch):
    """profile_num_blocks reads the free memory while the largest bucket's graph is captured, so
    the pool leaves room for the graphs' memory (the fake counts captures; a real device's free
    memory would drop by the graph pool)."""
    fake_npu = torch.npu
    captures = []
    capture_end = fake_npu.NPUGraph.capture_end

    def counting_capture_end(graph):
        capture_end(graph)
        captures.append(graph)

    monkeypatch.setattr(fake_npu.NPUGraph, "capture_end", counting_capture_end)
    seen = []
    platform = replace(xinserve.engines.core.engine.get_platform("npu:0"), free_memory=lambda: seen.append(len(captures)) or 2**30)
    monkeypatch.setattr(xinserve.engines.core.engine, "get_platform", lambda device: platform)
    model = tiny_models("llama", hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=1)
    llm = LLM(model, device="npu:0", compile="on", dtype="bfloat16", block_size=BS, max_num_seqs=4,
              max_model_len=256, max_num_batched_tokens=256)
    assert seen == [1]  # one graph (bucket 4) held while the pool was sized
    assert len(captures) == 1 + 3 and sorted(llm.engine.runner.decode_graphs.steps) == [1, 2, 4]


def test_an_mla_model_is_never_captured_on_ascend(npu_platform, tiny_models, caplog):
    """Ascend's MLA attention takes host lengths with no graph-task update: a replay would freeze them.
    The kernel says so (``graph_capturable = False``), the registry reports it, the runner decodes
    eagerly. DeepSeek's latent shapes (512 / 64), so the Ascend MLA attention is the one chosen."""
    model = tiny_models("deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64)
    with caplog.at_level("INFO", logger="xinserve.engines.worker.runner"):
        llm = LLM(model, device="npu:0", compile="on", dtype="bfloat16", block_size=BS, num_kv_blocks=16, max_num_seqs=2)
    runner = llm.engine.runner
    assert runner.kernels.chosen["mla_decode_attention"] == "npu"
    assert runner.kernels.uncapturable == {"mla_decode_attention": "npu"}
    assert runner.decode_graphs is None and runner.compile_mode == "off"
    assert "DeepseekV3ForCausalLM decodes eagerly on cpu: its kernels cannot be graph-captured yet" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3



def test_the_reference_mla_decode_is_declared_uncapturable_too(npu_platform, tiny_models):
    """With the tiny model's latent (32 / 8) the Ascend MLA attention declines and the reference one
    is chosen; it declares itself uncapturable (a captured replay on the fake graph differed from
    eager), so the model decodes eagerly, as every MLA model did before the kernels declared it."""
    model = tiny_models("deepseek_v3")
    llm = LLM(model, device="npu:0", compile="on", dtype="bfloat16", block_size=BS, num_kv_blocks=16, max_num_seqs=2)
    runner = llm.engine.runner
    assert runner.kernels.chosen["mla_decode_attention"] == "reference"
    assert runner.kernels.uncapturable == {"mla_decode_attention": "reference"}
    assert runner.decode_graphs is None and runner.compile_mode == "off"
