"""Our compact models against Hugging Face's on tiny random checkpoints, through the paged cache."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Glm4Config,
    Glm4MoeConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from xinserve.engines.model_loader import load_model
from xinserve.kernels.attention_metadata import AttentionMetadata, build_decode_gather

BLOCK_SIZE, NUM_BLOCKS = 4, 32
COMMON = {
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
}
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32),  # head_dim != hidden / heads
    "glm4": lambda: Glm4Config(**COMMON, head_dim=16, pad_token_id=0, eos_token_id=2),  # partial_rotary_factor 0.5, interleaved
    "llama_tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama3_rope": lambda: LlamaConfig(**COMMON, rope_parameters=dict(LLAMA3_ROPE)),
    # 8 experts top-2 after a dense first layer
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0]),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=6, num_experts_per_tok=2),
    # sigmoid routing with a bias, 2 groups, a shared expert, scaled weights, q/k norm, partial rotary
    "glm4_moe": lambda: Glm4MoeConfig(**COMMON, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=32, n_group=2, topk_group=1, first_k_dense_replace=1,
                                      routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True),
    # a 7-token window on every layer; on Qwen2's layer 1 only (max_window_layers)
    "mistral_window": lambda: MistralConfig(**COMMON, sliding_window=7),
    "qwen2_window": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=7, max_window_layers=1),
}
MOE_AND_WINDOWED = ["qwen3_moe", "mixtral", "glm4_moe", "mistral_window", "qwen2_window"]
STORIES = Path(__file__).resolve().parents[2] / "fixtures" / "stories260K"


def save_tiny(config, path: Path, seed: int = 0, **save_kwargs) -> Path:
    """A random HF model saved to ``path``. Every weight (norms, biases and GLM-4.5's router bias
    too) gets a random value of a size that gives logits of order one, so a missed bias or norm
    shows in the logits."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(path, **save_kwargs)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: save_tiny(make(), root / name, seed=i) for i, (name, make) in enumerate(CONFIGS.items())}


def hf_logits(path: Path, token_ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


class PagedRun:
    """Drives one of our models step by step over a small paged KV cache, the way the runner will."""

    def __init__(self, model: torch.nn.Module, blocks: dict[str, list[int]]) -> None:
        self.model = model
        param = next(model.parameters())
        self.kv_cache = torch.zeros(
            2, model.num_layers, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim, dtype=param.dtype
        )
        self.blocks = blocks  # sequence -> its KV block ids, deliberately out of order
        self.computed = {name: 0 for name in blocks}  # tokens already in the cache

    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """chunks: (sequence, new token ids), single-token decodes first. Returns each chunk's logits."""
        num_decode = 0
        while num_decode < len(chunks) and len(chunks[num_decode][1]) == 1 and self.computed[chunks[num_decode][0]]:
            num_decode += 1
        ids, positions, slots, tables, seq_lens = [], [], [], [], []
        for name, new in chunks:
            start = self.computed[name]
            seq_len = start + len(new)
            ids += new
            positions += list(range(start, seq_len))
            slots += [self.blocks[name][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions[-len(new):]]
            tables.append(self.blocks[name][: -(-seq_len // BLOCK_SIZE)])
            seq_lens.append(seq_len)
            self.computed[name] = seq_len
        width = max(len(t) for t in tables)
        prefill_lens = [len(new) for _, new in chunks[num_decode:]]
        block_tables = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
        lens = np.array(seq_lens, dtype=np.int32)
        gather = None
        if num_decode:
            gather = build_decode_gather(block_tables[:num_decode], lens[:num_decode], BLOCK_SIZE, torch.device("cpu"))
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.from_numpy(block_tables),
            seq_lens=torch.from_numpy(lens),
            num_decode_seqs=num_decode,
            prefill_query_start_loc=[sum(prefill_lens[:i]) for i in range(len(prefill_lens) + 1)],
            prefill_seq_lens=seq_lens[num_decode:],
            decode_gather=gather,
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_cache, metadata)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([len(new) for _, new in chunks]))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, COMMON["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_logits(path: Path, token_ids: list[int], dtype: torch.dtype | None = None) -> torch.Tensor:
    model, _ = load_model(str(path), dtype, torch.device("cpu"))
    blocks = [13, 2, 7, 21, 5, 16, 30, 9, 1, 24]
    (logits,) = PagedRun(model, {"a": blocks}).step([("a", token_ids)])
    return logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_matches_transformers(checkpoints: dict[str, Path], name: str) -> None:
    ids = prompt(20, seed=1)
    expected = hf_logits(checkpoints[name], ids)
    assert expected.std() > 0.1  # the random weights give a non-trivial distribution
    ours = prefill_logits(checkpoints[name], ids)
    assert ours.dtype == torch.float32 and ours.shape == (20, COMMON["vocab_size"])
    assert (ours - expected).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "glm4", *MOE_AND_WINDOWED])
def test_chunked_prefill_then_batched_decode(checkpoints: dict[str, Path], name: str) -> None:
    seq_a, seq_b = prompt(23, seed=2), prompt(11, seed=3)
    expected_a, expected_b = hf_logits(checkpoints[name], seq_a), hf_logits(checkpoints[name], seq_b)
    model, _ = load_model(str(checkpoints[name]), None, torch.device("cpu"))
    run = PagedRun(model, {"a": [13, 2, 7, 21, 5, 16], "b": [9, 30, 1]})
    got_a, got_b = [], []
    (chunk,) = run.step([("a", seq_a[:12])])  # prefill, no prefix
    got_a.append(chunk)
    (chunk,) = run.step([("a", seq_a[12:20])])  # second chunk after a cached 12-token prefix
    got_a.append(chunk)
    dec_a, pre_b = run.step([("a", seq_a[20:21]), ("b", seq_b[:9])])  # decode next to a prefill
    got_a.append(dec_a)
    got_b.append(pre_b)
    for i in range(2):  # two steps with both sequences decoding
        dec_a, dec_b = run.step([("a", seq_a[21 + i : 22 + i]), ("b", seq_b[9 + i : 10 + i])])
        got_a.append(dec_a)
        got_b.append(dec_b)
    assert (torch.cat(got_a) - expected_a).abs().max() < 1e-4
    assert (torch.cat(got_b) - expected_b).abs().max() < 1e-4


def test_sharded_checkpoint(tmp_path: Path) -> None:
    path = save_tiny(LlamaConfig(**COMMON), tmp_path / "sharded", seed=7, max_shard_size="60KB")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    ids = prompt(20, seed=4)
    assert (prefill_logits(path, ids) - hf_logits(path, ids)).abs().max() < 1e-4


def test_bfloat16_load(checkpoints: dict[str, Path]) -> None:
    ids = prompt(20, seed=5)
    model, _ = load_model(str(checkpoints["qwen2"]), torch.bfloat16, torch.device("cpu"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ours = prefill_logits(checkpoints["qwen2"], ids, torch.bfloat16)
    expected = hf_logits(checkpoints["qwen2"], ids, torch.bfloat16)
    reference32 = hf_logits(checkpoints["qwen2"], ids)
    # bf16 rounding differs in detail from HF's; the error must stay at HF's own bf16 level
    assert (ours - expected).abs().max() < 0.1
    hf_error = (expected - reference32).abs().max()
    assert (ours - reference32).abs().max() < 2 * hf_error + 0.02
    assert (ours.argmax(-1) == reference32.argmax(-1)).float().mean() > 0.9


def test_model_sizes_for_the_kv_cache(checkpoints: dict[str, Path]) -> None:
    model, config = load_model(str(checkpoints["qwen3"]), None, torch.device("cpu"))
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 32)
    assert config.model_type == "qwen3"
    assert not any(p.requires_grad for p in model.parameters())


def test_unsupported_architecture(tmp_path: Path) -> None:
    LlamaConfig(**COMMON, architectures=["FancyForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="FancyForCausalLM.*LlamaForCausalLM"):
        load_model(str(tmp_path), None, torch.device("cpu"))


def test_missing_weight_is_named(tmp_path: Path) -> None:
    path = save_tiny(LlamaConfig(**COMMON), tmp_path / "m", seed=8)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 weights: model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(str(path), None, torch.device("cpu"))


def test_stories260k_matches_transformers() -> None:
    ids = [1, 403, 407, 261, 378, 24, 8, 299, 269, 263, 353, 344, 261, 7, 395, 329, 267, 322, 46, 2]
    expected = hf_logits(STORIES, ids)
    assert (prefill_logits(STORIES, ids) - expected).abs().max() < 1e-4


@pytest.mark.parametrize("field, value, named", [
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0},
     "rope_parameters.rope_type='dynamic'"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
])
def test_a_math_changing_config_field_that_is_not_implemented_fails_loading(tmp_path: Path, field, value,
                                                                               named) -> None:
    path = save_tiny(LlamaConfig(**COMMON), tmp_path / "m", seed=9)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM .*not implemented.*" + re.escape(named)):
        load_model(str(path), None, torch.device("cpu"))


def test_an_unknown_attention_layer_type_fails_loading(tmp_path: Path) -> None:
    path = save_tiny(Qwen2Config(**COMMON), tmp_path / "q", seed=10)
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = ["full_attention", "chunked_attention"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape("layer_types=['chunked_attention']")):
        load_model(str(path), None, torch.device("cpu"))


def test_a_missing_expert_weight_is_named(tmp_path: Path) -> None:
    path = save_tiny(CONFIGS["qwen3_moe"](), tmp_path / "moe", seed=11)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 weights: model\.layers\.1\.mlp\.experts\.gate_up_proj#e5#s1$"):
        load_model(str(path), None, torch.device("cpu"))


def test_glm4_moe_skips_its_multi_token_prediction_layer_and_keeps_its_router_in_float32(
        checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """GLM-4.5 checkpoints carry an extra layer past num_hidden_layers for speculative decoding."""
    weights = load_file(checkpoints["glm4_moe"] / "model.safetensors")
    weights["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    weights["model.layers.2.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)
    (tmp_path / "config.json").write_text((checkpoints["glm4_moe"] / "config.json").read_text())
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, _ = load_model(str(tmp_path), torch.bfloat16, torch.device("cpu"))
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    ids = prompt(20, seed=12)
    expected = hf_logits(checkpoints["glm4_moe"], ids, torch.bfloat16)
    assert (prefill_logits(tmp_path, ids, torch.bfloat16) - expected).abs().max() < 0.1
