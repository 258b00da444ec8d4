"""Expert parallelism on two CPU ranks (gloo): whole experts per rank, tokens exchanged all-to-all.

Greedy tokens equal transformers' for Qwen3-MoE, GLM-4.5 and DeepSeek-V3 (attention replicated: MLA
has no tensor-parallel split here) under batching, preemption, prefix hits and chunked prefill; the
dispatch equals the reference ``fused_moe`` under a non-trivial placement, with ranks that receive no
token; each rank reads only its own experts; bad splits name the model."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig

from tests.engines.parallel.ep_dispatch_rank import run_rank
from tests.engines.parallel.test_tensor_parallel import LoadOnly, RecordingSafeOpen, checkpoint
from tests.engines.test_llm_vs_transformers import GREEDY, Reference, assert_all_blocks_free, random_prompts
from xinserve.engines import LLM
from xinserve.engines import model_loader as loader
from xinserve.engines.model_loader import load_model
from xinserve.engines.models.expert_parallel import ExpertPlacement


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_experts_over_two_ranks_match_transformers(tiny_models, arch):
    """11 prompts, 5 sharing a 3-block prefix, a 24-block pool (preemption), an 8-token budget
    (chunked prefill): every token equals transformers'."""
    path = tiny_models(arch)
    ref = Reference(path)
    prefix = random_prompts(1, ref.vocab_size, seed=3, lengths=(12, 12))[0]
    prompts = (random_prompts(6, ref.vocab_size, seed=2, lengths=(10, 30))
               + random_prompts(5, ref.vocab_size, seed=4, lengths=(1, 9), prefix=prefix))
    with LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, num_kv_blocks=24, block_size=4,
             max_num_batched_tokens=8) as llm:
        results = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
        counts = llm.engine.runner.group.counts
        exchange = llm.engine.runner.kernels.report()["ep_dispatch"]
        roles = [(r["role"]["tp_rank"], r["role"]["expert_range"]) for r in llm.engine.runner.ranks()]
        assert_all_blocks_free(llm)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == ref.generate(prompt), f"prompt of {len(prompt)} tokens diverged"
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    assert counts["all_to_all"] > 0 and counts["all_gather"] > 0
    assert roles == [(0, "0-3"), (1, "4-7")]
    assert exchange == {"chosen": "all_to_all", "rejected": []}  # no fused exchange on the CPU


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(target, placement: ExpertPlacement, num_results: int) -> list:
    """Run ``target(rank, port, placement, queue)`` on two spawned ranks; the ``num_results`` they queue."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=target, args=(rank, port, placement, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=120) for _ in range(num_results)]
    for proc in procs:
        proc.join(10)
    return results


def test_dispatch_under_a_permuted_placement_equals_the_reference():
    placement = ExpertPlacement((5, 2, 7, 0, 3, 6, 1, 4), num_ranks=2)
    assert placement.local_experts(1) == [3, 6, 1, 4]
    assert placement.describe(1) == "3,6,1,4" and ExpertPlacement.contiguous(8, 2).describe(1) == "4-7"
    for rank, tokens, got, want in run_two_ranks(run_rank, placement, 6):
        if tokens:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # per call: the counts in, the rows, the results back; the chunks gathered
            assert got == {"all_to_all": 6, "all_gather": 2}
    assert not dist.is_initialized()


def test_each_rank_reads_only_its_experts(tiny_models, monkeypatch):
    path = tiny_models("qwen3_moe")
    full = checkpoint(path)
    cfg = AutoConfig.from_pretrained(path)
    monkeypatch.setattr(loader, "safe_open", RecordingSafeOpen)
    for rank in range(2):
        RecordingSafeOpen.reads = {}
        model, _ = load_model(str(path), torch.float32, torch.device("cpu"), group=LoadOnly(rank, 2),
                              expert_parallel=True)
        params = dict(model.named_parameters())
        mlp = "model.layers.1.mlp"
        mine = range(rank * cfg.num_experts // 2, (rank + 1) * cfg.num_experts // 2)
        for slot, e in enumerate(mine):
            gate_up = torch.cat([full[f"{mlp}.experts.{e}.gate_proj.weight"], full[f"{mlp}.experts.{e}.up_proj.weight"]])
            assert torch.equal(params[f"{mlp}.experts.gate_up_proj"][slot], gate_up)
            assert torch.equal(params[f"{mlp}.experts.down_proj"][slot], full[f"{mlp}.experts.{e}.down_proj.weight"])
        read_experts = {int(name.split(".")[5]) for name in RecordingSafeOpen.reads if ".experts." in name}
        assert read_experts == set(mine)


def test_experts_that_do_not_divide_name_the_model(tiny_models):
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM at .*enable_expert_parallel over 3 ranks does "
                                         r"not fit: 8 routed experts do not divide by 3"):
        LLM(tiny_models("qwen3_moe", num_heads=6, num_kv_heads=3, hidden_size=48, intermediate_size=96),
            tensor_parallel_size=3, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="must list every expert once"):
        ExpertPlacement((0, 0, 1, 2), num_ranks=2)
