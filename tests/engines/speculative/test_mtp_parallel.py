"""Speculative method ``mtp`` on models as fleets serve them: split over ranks and quantized.

- A block-FP8 DeepSeek-V3 whose MTP layer is quantized like its decoder layers (eh_proj included): the
  draft logits equal the plain-torch reference over the dequantized weights.
- Two real gloo ranks on one device: block-FP8 DeepSeek-V3 at TP 2, and GLM-5 (MLA + DSA, a MoE MTP
  layer) at TP 2 with its experts over the 2 ranks (EP 2). Greedy output equals transformers, and rank
  0 drafts exactly what one device drafts: with the MTP layer split, its collectives and the draft
  logits' all-gather, every rank runs the same drafts (a rank that drafted otherwise would feed the
  all-reduces other inputs, and the drafts would differ).
"""

from pathlib import Path

import pytest
import torch

from tests.engines.parallel.test_tensor_parallel import LoadOnly
from tests.engines.quantization.checkpoints import fp8_blocks, write_quantized
from tests.engines.quantization.test_quantized_parallel import held_bytes
from tests.engines.speculative.test_mtp_reference import check_draft_logits
from tests.engines.test_llm_vs_transformers import GREEDY, Reference
from xinserve.engines import LLM
from xinserve.engines.core.capacity import Layout, plan
from xinserve.engines.model_loader import load_model

CPU = torch.device("cpu")

MTP = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 64}
PROMPTS = [[1, 17, 42, 99, 7, 250, 17, 42, 99], [1, 5, 300, 12, 8, 8, 31]]


@pytest.fixture(scope="module")
def fp8_deepseek(tiny_models, tmp_path_factory) -> tuple[Path, Path]:
    """(the block-FP8 checkpoint with its MTP layer, the same weights dequantized in floats)."""
    root = tmp_path_factory.mktemp("fp8-mtp")
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    write_quantized(Path(tiny_models("deepseek_v3", mtp=True)), root / "q", root / "oracle", fp8_blocks((16, 16)),
                    config)
    return root / "q", root / "oracle"


def test_quantized_mtp_draft_logits_equal_the_dequantized_reference(fp8_deepseek):
    quantized, oracle = fp8_deepseek
    check_draft_logits(quantized, oracle, atol=1e-3)


def _generate(path: Path, **parallel) -> tuple[list[list[int]], list, tuple]:
    """Greedy tokens, rank 0's drafts of every chain, and the acceptance counts."""
    with LLM(str(path), num_kv_blocks=64, block_size=4, max_model_len=128, speculative_config=MTP, **parallel) as llm:
        runner, drafts = llm.engine.runner, []
        run_chain = runner._run_chain

        def spy(work):
            drafts.append(run_chain(work))
            return drafts[-1]

        runner._run_chain = spy
        tokens = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
        spec = llm.engine.stats().spec_decode
        return tokens, drafts, (spec.num_draft_tokens, spec.num_accepted_tokens, spec.accepted_per_position)


@pytest.mark.parametrize(("arch", "parallel"), [
    ("fp8_deepseek_v3", {"tensor_parallel_size": 2}),
    ("glm_moe_dsa", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
])
def test_mtp_over_two_ranks_equals_transformers_and_drafts_as_one_device(tiny_models, fp8_deepseek, arch, parallel):
    path, oracle = fp8_deepseek if arch.startswith("fp8_") else (tiny_models(arch, mtp=True),) * 2
    reference = Reference(oracle)
    tokens, drafts, counts = _generate(path, **parallel)
    assert tokens == [reference.generate(prompt) for prompt in PROMPTS]
    one_tokens, one_drafts, one_counts = _generate(path)
    assert drafts and drafts == one_drafts and counts == one_counts and tokens == one_tokens
    assert counts[0] > 0


@pytest.mark.parametrize(("layout", "scheme"), [(Layout(tp=2, ep=True), "w8a8"), (Layout(tp=2), "none")])
def test_the_plan_with_mtp_holds_what_every_rank_loads(tiny_models, layout, scheme):
    """The MTP layer split like the target's layers (w8a8: its projections, eh_proj and its experts
    quantized, its norms and own head float; its experts whole under EP) and its KV layer."""
    path = str(tiny_models("deepseek_v3", mtp=True, mtp_own_head=True))
    held, kv = [], []
    for rank in range(layout.tp):
        model, _ = load_model(path, None, CPU, quantization=None if scheme == "none" else scheme,
                              group=LoadOnly(rank, layout.tp), expert_parallel=layout.ep, mtp=True)
        held.append(held_bytes(model))
        kv.append(model.kv_bytes_per_token(torch.bfloat16))
    planned = plan(path, layout=layout, quantization=scheme, mtp=True, dtype=torch.float32, kv_cache_dtype="bfloat16")
    assert planned.weight_bytes_per_device == max(held)
    assert planned.kv_bytes_per_token_per_device == max(kv)
    without = plan(path, layout=layout, quantization=scheme, dtype=torch.float32, kv_cache_dtype="bfloat16")
    assert planned.weight_bytes_per_device > without.weight_bytes_per_device
    assert planned.kv_bytes_per_token_per_device > without.kv_bytes_per_token_per_device
