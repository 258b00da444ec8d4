"""The offline tiny-model factory: deterministic files, a lossless tokenizer, loadable models."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from xinserve.server.embedded_model.factory import ARCHS, ensure_tiny_model, make_tiny_model
from xinserve.server.embedded_model.tokenizer import build_tokenizer

TEXTS = [
    "The river meets the sea.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines\r\n",
    "naïve café, Straße, façade",
    "日本語のテキスト and 中文",
    "emoji 🤖🚀 and combining e\u0301",
    "numbers 3.14159 -42 1e-6 0x1F",
    "",
]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_same_inputs_give_byte_identical_files(tmp_path: Path) -> None:
    first = make_tiny_model(tmp_path / "a", "qwen2", seed=3)
    second = make_tiny_model(tmp_path / "b", "qwen2", seed=3)
    names = sorted(p.name for p in first.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_seed_changes_weights(tmp_path: Path, tiny_models) -> None:
    other = make_tiny_model(tmp_path / "seed1", "llama", seed=1)
    base = _tensors(tiny_models("llama"))
    changed = _tensors(other)
    assert base.keys() == changed.keys()
    assert not torch.equal(base["lm_head.weight"], changed["lm_head.weight"])


def test_special_tokens_and_size(tokenizer) -> None:
    assert len(tokenizer) == 1000
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    for marker in ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id  # BOS only with add_special_tokens (the default)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    plain = tokenizer.encode(text, add_special_tokens=False)
    assert plain == ids[1:]
    assert tokenizer.decode(plain) == text


def test_bpe_merges_common_words(tokenizer) -> None:
    # A trained vocabulary, not bytes: corpus words become few tokens.
    text = "the river and the sea"
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text.encode()) / 2


def test_chat_template_renders_roles_and_generation_prompt(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # template survives save/load
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "rain"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|system|>\nBe brief.<|end_of_text|>\n<|user|>\nWeather?<|end_of_text|>\n"
        "<|assistant|>\n<|end_of_text|>\n<|tool|>\nrain<|end_of_text|>\n<|assistant|>\n"
    )
    closed = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert closed.endswith("Weather?<|end_of_text|>\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    with pytest.raises(Exception, match="unsupported chat role"):
        tokenizer.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_arch_loads_and_generates(tiny_models, arch: str) -> None:
    path = tiny_models(arch)
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == arch
    # multi-head latent attention: head_dim is the rotary slice transformers rotates
    mla_rope_dim = getattr(config, "qk_rope_head_dim", None)
    assert config.head_dim == (mla_rope_dim or config.hidden_size // config.num_attention_heads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.vocab_size == len(tokenizer)  # AutoTokenizer picks per-arch classes (Qwen2Tokenizer)
    text = "Dear Sam, the river is 12 km long."
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text
    assert GenerationConfig.from_pretrained(path).eos_token_id == tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == config.architectures[0]

    outputs = []
    for prompt in ("The river", "Good software is", "Dear Sam"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert out.shape == (1, ids.shape[1] + 12)
        outputs.append(out[0, ids.shape[1] :].tolist())
    # Random weights must still give varied greedy text, not one token repeated for every prompt.
    assert len({token for tokens in outputs for token in tokens}) > 6
    assert len({tuple(tokens) for tokens in outputs}) == 3


def test_arch_specific_weights(tiny_models) -> None:
    qwen2 = _tensors(tiny_models("qwen2"))
    assert qwen2["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0  # random, not HF's zeros
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2
    qwen3 = _tensors(tiny_models("qwen3"))
    assert qwen3["model.layers.0.self_attn.q_norm.weight"].shape == (16,)
    glm4_config = AutoConfig.from_pretrained(tiny_models("glm4"))
    assert glm4_config.rope_parameters["partial_rotary_factor"] == 0.5
    llama = _tensors(tiny_models("llama"))
    norm = llama["model.layers.0.input_layernorm.weight"]
    assert not torch.allclose(norm, torch.ones_like(norm))  # norm weights matter in our tests
    glm4_moe = _tensors(tiny_models("glm4_moe"))  # per-expert checkpoint names, a dense first layer
    assert glm4_moe["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert "model.layers.0.mlp.gate_proj.weight" in glm4_moe and "model.layers.0.mlp.gate.weight" not in glm4_moe
    assert glm4_moe["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0  # not HF's zeros
    assert "model.layers.1.block_sparse_moe.experts.5.w3.weight" in _tensors(tiny_models("mixtral"))


def test_options_shape_the_checkpoint(tmp_path: Path) -> None:
    path = make_tiny_model(
        tmp_path / "m", "llama", vocab_size=1024, tie_word_embeddings=True, dtype=torch.bfloat16, num_layers=1
    )
    tensors = _tensors(path)
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].shape == (1024, 64)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert AutoConfig.from_pretrained(path).num_hidden_layers == 1
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny_model(tmp_path / "bad", "gpt2")
    with pytest.raises(ValueError, match="smaller than"):
        make_tiny_model(tmp_path / "small", vocab_size=10)


def test_ensure_builds_once_then_reuses(tmp_path: Path) -> None:
    path = ensure_tiny_model(tmp_path, num_layers=1)
    assert path == tmp_path / "xinserve-tiny"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path, num_layers=1) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["xinserve-tiny"]  # no staging dirs left behind
    assert AutoConfig.from_pretrained(path).num_hidden_layers == 1
