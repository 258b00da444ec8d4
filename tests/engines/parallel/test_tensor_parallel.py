"""Tensor parallelism on the CPU with two ranks (gloo): greedy tokens equal transformers' on every
dense test architecture under batching, preemption, prefix caching and chunked prefill together
(one two-rank group per model: starting ranks costs seconds); each rank loads exactly its slice of
every weight (routed experts: their intermediate slice) and never reads a full q/k/v, MLP,
embedding or LM-head tensor; bad groups fail with a message naming the model."""

import socket
from typing import ClassVar

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from tests.engines.test_llm_vs_transformers import (
    MAX_TOKENS,
    Reference,
    assert_all_blocks_free,
    random_prompts,
)
from xinserve.engines import LLM, SamplingParams
from xinserve.engines import model_loader as loader
from xinserve.engines.model_loader import load_model
from xinserve.engines.parallel.parallel_config import ParallelConfig

MODELS = {
    "llama": ("llama", {}),
    "qwen2_one_kv_head": ("qwen2", {"num_kv_heads": 1}),  # the KV head replicated on both ranks
    "qwen3": ("qwen3", {}),
    "glm4": ("glm4", {}),  # a fused gate_up_proj in the checkpoint, o_proj without bias, sandwich norms
    "glm4_moe": ("glm4_moe", {}),  # experts split along their intermediate dim, a shared expert, q/k norm
}
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(params=[*MODELS, "stories260K"])
def model_dir(request, tiny_models):
    if request.param == "stories260K":
        return request.getfixturevalue("stories_dir")
    arch, kwargs = MODELS[request.param]
    return tiny_models(arch, **kwargs)


def test_two_ranks_match_transformers_with_preemption_prefix_caching_and_chunks(model_dir, request):
    """11 prompts at once, 5 sharing a 3-block prefix, in a 24-block pool (preemption) with an
    8-token step budget (chunked prefill); then (on Llama) echo with prompt log-probs and sampled
    log-probs, equal to one device's."""
    reference = Reference(model_dir)
    prefix = random_prompts(1, reference.vocab_size, seed=3, lengths=(12, 12))[0]
    prompts = (random_prompts(6, reference.vocab_size, seed=2, lengths=(10, 30))
               + random_prompts(5, reference.vocab_size, seed=4, lengths=(1, 9), prefix=prefix))
    options = {"num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 8}
    echo = SamplingParams(temperature=0, max_tokens=2, logprobs=3, prompt_logprobs=2)
    with LLM(model_dir, tensor_parallel_size=2, **options) as llm:
        results = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
        assert_all_blocks_free(llm)
        sharded_echo = llm.generate(prompts[:3], echo) if "[llama]" in request.node.name else None
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference.generate(prompt), f"prompt of {len(prompt)} tokens diverged"
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits_total > 0
    if sharded_echo is None:
        return
    single_echo = LLM(model_dir, **options).generate(prompts[:3], echo)
    for a, b in zip(sharded_echo, single_echo):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.top_token_ids == y.top_token_ids
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=1e-4)


class LoadOnly:
    """Rank ``rank`` of ``world_size`` for loading only: loading runs no collective."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, x):
        raise AssertionError("loading runs no collective")

    def gather_logits(self, logits, vocab_size):
        raise AssertionError("loading runs no collective")


class RecordingSafeOpen:
    """safe_open that records how many elements were read per tensor and forbids whole reads."""

    reads: ClassVar[dict[str, int]] = {}

    def __init__(self, *args, **kwargs) -> None:
        self.file = safe_open(*args, **kwargs)

    def __enter__(self):
        self.handle = self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name):
        raise AssertionError(f"a rank read the whole of {name}")

    def get_slice(self, name):
        piece, reads = self.handle.get_slice(name), RecordingSafeOpen.reads

        class Recorded:
            def get_shape(self):
                return piece.get_shape()

            def __getitem__(self, index):
                tensor = piece[index]
                reads[name] = reads.get(name, 0) + tensor.numel()
                return tensor

        return Recorded()


def checkpoint(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names = f.keys()  # the handle itself is not iterable
            out.update({name: f.get_tensor(name) for name in names})
    return out


@pytest.mark.parametrize("arch,kwargs", [("llama", {}), ("qwen2", {"num_kv_heads": 1}), ("glm4", {}),
                                         ("qwen3_moe", {})])
def test_each_rank_loads_exactly_its_slice(tiny_models, monkeypatch, arch, kwargs):
    path = tiny_models(arch, **kwargs)
    full = checkpoint(path)
    cfg = AutoConfig.from_pretrained(path)
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inter, vocab = cfg.intermediate_size, cfg.vocab_size
    monkeypatch.setattr(loader, "safe_open", RecordingSafeOpen)
    for rank in range(2):
        RecordingSafeOpen.reads = {}
        model, _ = load_model(str(path), torch.float32, torch.device("cpu"), group=LoadOnly(rank, 2))
        params = dict(model.named_parameters())
        q = slice(rank * heads // 2 * d, (rank + 1) * heads // 2 * d)
        kv_head = rank * kv_heads // 2
        kv = slice(kv_head * d, (kv_head + max(1, kv_heads // 2)) * d)
        i = slice(rank * inter // 2, (rank + 1) * inter // 2)
        attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
        qkv = torch.cat([full[f"{attn}.q_proj.weight"][q], full[f"{attn}.k_proj.weight"][kv],
                         full[f"{attn}.v_proj.weight"][kv]])
        assert torch.equal(params[f"{attn}.qkv_proj.weight"], qkv)
        assert torch.equal(params[f"{attn}.o_proj.weight"], full[f"{attn}.o_proj.weight"][:, q])
        if arch == "qwen3_moe":  # layer 1 is sparse: every expert's slice of its intermediate dim
            m = cfg.moe_intermediate_size
            e = slice(rank * m // 2, (rank + 1) * m // 2)
            for k in range(cfg.num_experts):
                gate_up = torch.cat([full[f"{mlp}.experts.{k}.gate_proj.weight"][e],
                                     full[f"{mlp}.experts.{k}.up_proj.weight"][e]])
                assert torch.equal(params[f"{mlp}.experts.gate_up_proj"][k], gate_up)
                assert torch.equal(params[f"{mlp}.experts.down_proj"][k], full[f"{mlp}.experts.{k}.down_proj.weight"][:, e])
        else:
            gate_up = (full[f"{mlp}.gate_up_proj.weight"].chunk(2) if arch == "glm4"
                       else (full[f"{mlp}.gate_proj.weight"], full[f"{mlp}.up_proj.weight"]))
            assert torch.equal(params[f"{mlp}.gate_up_proj.weight"], torch.cat([gate_up[0][i], gate_up[1][i]]))
            assert torch.equal(params[f"{mlp}.down_proj.weight"], full[f"{mlp}.down_proj.weight"][:, i])
        rows = -(-vocab // 2)
        embed = params["model.embed_tokens.weight"]
        mine = full["model.embed_tokens.weight"][rank * rows : (rank + 1) * rows]
        assert torch.equal(embed[: len(mine)], mine) and not embed[len(mine) :].any()
        assert model.num_kv_heads == max(1, kv_heads // 2)
        # No rank read all of a sharded weight: at most half of it (a replicated KV head: all of k/v).
        for name, count in RecordingSafeOpen.reads.items():
            if any(part in name for part in ("q_proj", "gate_", "up_proj", "down_proj", "o_proj.weight",
                                             "embed_tokens", "lm_head")):
                assert count <= -(-full[name].numel() // 2) + full[name].shape[-1], name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_groups_name_the_model(tiny_models):
    path = tiny_models("llama")  # 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match=r"LlamaForCausalLM at .*3 does not fit: 4 attention heads"):
        LLM(path, tensor_parallel_size=3)
    mixed = ParallelConfig(devices=["cpu", "cuda:0"])
    with pytest.raises(ValueError, match=r"model .*mixes platforms"):
        LLM(path, tensor_parallel_size=2, parallel=mixed)
    with pytest.raises(ValueError, match=r"model .*npu:1 is listed twice"):
        LLM(path, tensor_parallel_size=2, parallel=ParallelConfig(devices=["npu:1", "npu:1"]))
    with pytest.raises(ValueError, match="experts' intermediate size 32 .* does not divide by 3"):
        LLM(tiny_models("qwen3_moe", num_heads=6, num_kv_heads=3, hidden_size=48, intermediate_size=96), tensor_parallel_size=3)


def test_a_rank_that_never_joins_fails_the_group_with_a_clear_message(tiny_model_dir):
    """Two nodes, and the second never starts: rank 0 gives up after the rendezvous timeout."""
    lonely = ParallelConfig(devices=["cpu", "cpu"], nnodes=2, master_port=_free_port(), rendezvous_timeout_s=1.5)
    with pytest.raises(RuntimeError, match=r"did not assemble at 127.0.0.1:\d+ within 1.5s"):
        LLM(tiny_model_dir, tensor_parallel_size=2, parallel=lonely)


def test_the_pool_is_sized_from_each_ranks_free_memory(tiny_model_dir):
    """Without ``num_kv_blocks`` every rank measures its own free memory after the warm-up step and
    the group takes the smallest count (one all-reduce over the control group)."""
    from xinserve.engines.platforms import get_platform

    fraction = 1e-4
    reference = Reference(tiny_model_dir)
    prompts = random_prompts(3, reference.vocab_size, seed=5)
    with LLM(tiny_model_dir, tensor_parallel_size=2, kv_cache_memory_fraction=fraction,
             max_num_batched_tokens=64) as llm:
        runner, bm = llm.engine.runner, llm.engine.block_manager
        assert 0 < bm.num_blocks * runner.bytes_per_block() <= 1.5 * fraction * get_platform("cpu").free_memory()
        assert runner.kv_cache.shape[2] == bm.num_blocks + 1  # plus the scratch block
        results = llm.generate(prompts, GREEDY)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference.generate(prompt)


def test_an_accelerator_group_defaults_to_consecutive_cards():
    from xinserve.engines.parallel.tp_runner import default_devices

    assert default_devices("cpu", 2) == ["cpu", "cpu"]
    assert default_devices("npu", 4) == ["npu:0", "npu:1", "npu:2", "npu:3"]
    assert default_devices("cuda:2", 2) == ["cuda:2", "cuda:3"]
