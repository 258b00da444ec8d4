"""Offline factory for tiny Hugging Face models: tests, the benchmark and the embedded default model.

Everything is built locally and deterministically (no downloads): a byte-level BPE tokenizer trained
on the short corpus below, and a randomly initialised Llama-family model saved as a regular
Hugging Face directory (config.json, generation_config.json, model.safetensors, tokenizer files).
Same arguments -> byte-identical files, so tests can compare runs and caches can be trusted.
"""

import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GenerationConfig,
    Glm4Config,
    Glm4ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
ROLES = ("system", "user", "assistant", "tool")
ROLE_TOKENS = tuple(f"<|{role}|>" for role in ROLES)
# Ids 0..6 in this order: tests and the engine may rely on bos=0, eos=1, pad=2.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)

# Each message is "<|role|>\n{content}<|end_of_text|>\n", so an assistant turn ends on EOS and the
# engine needs a single stop id. Unknown roles are an error rather than a silently odd prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Plain English written for this module; enough distinct words for ~1000 BPE merges.
CORPUS = """\
The morning fog rolled slowly over the harbour, and the fishing boats waited at their moorings
until the light grew strong enough to see the rocks beyond the breakwater. An old sailor sat on
the steps of the customs house, mending a net with quick, patient fingers. He had done the same
work every spring for forty-two years, and he could tell the weather from the colour of the gulls.

A small library stood at the corner of the market square. Its shelves held atlases, cookbooks,
histories of forgotten kingdoms and a few novels that nobody had borrowed since 1987. The
librarian, a tall woman with silver glasses, believed that every book waited for its reader, and
that the waiting was part of the story. Children came on Saturdays to hear her read aloud.

Computers follow instructions one step at a time. A program is a list of such steps, written in a
language that both people and machines can understand. When a program runs, the processor fetches
each instruction from memory, decodes it, and executes it. Modern chips do many of these things in
parallel, which is why a laptop can play music, download files and check the spelling of a letter
all at once. Still, the basic idea has not changed since the first machines filled whole rooms.

To bake simple bread, mix 500 grams of flour with 10 grams of salt, 7 grams of yeast and 350
millilitres of warm water. Knead the dough for ten minutes until it feels smooth and elastic. Let
it rise in a warm place for about an hour, then shape it into a loaf, cover it, and wait another
forty minutes. Bake at 220 degrees for thirty minutes, or until the crust is golden and the loaf
sounds hollow when you tap the bottom.

The river begins as a spring high in the mountains, where snow melts under the summer sun. It
gathers streams from the valleys, turns mills in the old villages, and grows wide and slow as it
crosses the plain. Herons stand in the shallows, frogs sing in the reeds, and in the evening the
water reflects the orange sky. At last the river meets the sea, and its fresh water mixes with
the salt tide in a broad, muddy estuary full of birds.

Questions are the beginning of science. Why does the moon change its shape? Why do leaves turn red
and yellow in autumn? How far away are the stars? People have asked these questions for thousands
of years. Careful observation, honest measurement and clear reasoning slowly turned guesses into
knowledge. A good experiment can be repeated by anyone, anywhere, and it should give the same
answer each time. That is what makes a result worth trusting.

"Could you help me plan a trip?" asked the traveller. "Of course," said the guide. "Where would you
like to go, and how many days do you have?" They talked about trains and ferries, cheap hotels and
quiet beaches, museums that open late and restaurants that serve fresh fish. By the end of the
afternoon they had a plan for nine days, three cities and one very long walk along the coast.

Good software is tested. Each function should do one thing, have a clear name, and return the
same output for the same input. Tests check that the answer is right today and stays right after
someone changes the code tomorrow. When a test fails, read the message, find the smallest example
that shows the problem, fix the cause rather than the symptom, and then run the tests again.

On the first warm evening of the year the whole street carried chairs outside. Neighbours who had
nodded at each other all winter now shared lemonade, gossip and advice about tomatoes. A boy
practised the violin by an open window, badly at first and then a little better, while two dogs
argued about a stick. Nobody wanted to go back indoors before the stars came out.

Mathematics is the study of patterns. Two plus two is four, the angles of a triangle add up to 180
degrees, and a prime number has exactly two divisors. Some patterns are easy to notice but hard to
prove; others hide for centuries until someone looks at them from a new direction. Numbers like 3,
5, 8, 13 and 21 appear in sunflowers, pine cones and shells, which surprises almost everyone.

The weather report for tomorrow: cloudy in the north with light rain after midday, bright and
breezy in the south, and temperatures between 12 and 19 degrees. Winds will be westerly, becoming
strong near the coast in the evening. Drivers should expect mist on high roads early on Thursday.

Dear Sam, thank you for your kind letter and the photographs from your holiday. The garden here is
full of roses, the cat has learned to open the kitchen door, and I finally finished painting the
fence. Please write again soon, and give my best wishes to your family. With love, Ellen.
"""


def _train_bpe(vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so any UTF-8 text encodes and decodes exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Prepend BOS on encode(add_special_tokens=True), like Llama 3; chat prompts get it from the
    # template and must be encoded with add_special_tokens=False.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def build_tokenizer(vocab_size: int = 1000, model_max_length: int = 2048) -> PreTrainedTokenizerFast:
    """The tiny tokenizer in memory (see ``make_tokenizer``)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(vocab_size),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Byte-level BPE never needs an unknown token, but without one AutoTokenizer loads a qwen2
        # checkpoint as Qwen2Tokenizer, which then appends "<|endoftext|>" past the model's vocab.
        unk_token=EOS_TOKEN,
        extra_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # the clean-up rewrites " ." to "." and breaks round trips
        model_max_length=model_max_length,
    )


def make_tokenizer(
    path: str | Path, vocab_size: int = 1000, model_max_length: int = 2048
) -> PreTrainedTokenizerFast:
    """Train the tiny tokenizer and save it into ``path``; returns the tokenizer."""
    tokenizer = build_tokenizer(vocab_size, model_max_length)
    tokenizer.save_pretrained(str(path))
    return tokenizer


_MLA = {
    "num_key_value_heads": 4, "head_dim": 8, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
    "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}
# 16 indexer heads: a position scores exactly 0 (a tie whose order transformers itself breaks differently
# in its cached and uncached paths) only when all 16 relu to 0, which these tests never meet.
_DSA = {"index_topk": 12, "index_head_dim": 16, "index_n_heads": 16}
# arch -> (config class, model class, arch-specific config defaults).
ARCHS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    # No sliding window (the default 4096 is inert at our lengths anyway); override to test one.
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v biases are built into Qwen2
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),  # per-head q/k RMSNorm is built into Qwen3
    "glm4": (Glm4Config, Glm4ForCausalLM, {"partial_rotary_factor": 0.5, "attention_bias": True}),
    # Mixture-of-experts, small and odd on purpose: 8 experts top-2 with a dense first layer;
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "mlp_only_layers": [0]}),
    # 6 experts top-2 on every layer;
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 6, "num_experts_per_tok": 2}),
    # 8 experts in 2 groups (top-2 from the best group), a shared expert, a dense first layer, scaled
    # weights, q/k norm and partial rotary.
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM, {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
        "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5}),
    # Multi-head latent attention with GLM-4.5's kind of experts (3 layers: the first dense). One
    # latent head: num_key_value_heads equals the query heads, as transformers' MLA expects.
    # head_dim is the rotary width (qk_rope_head_dim), which transformers rotates by.
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, {**_MLA, "num_hidden_layers": 3}),
    # ... plus the DSA indexer, which keeps index_topk = 12 positions: shorter than most test prompts
    "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM, {**_MLA, **_DSA, "num_hidden_layers": 3}),
    "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, {**_MLA, **_DSA, "num_hidden_layers": 3}),
}


def make_config(
    arch: str,
    *,
    vocab_size: int,
    bos_token_id: int,
    eos_token_id: int,
    pad_token_id: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    **config_overrides,
) -> PretrainedConfig:
    """A Hugging Face config for one of ``ARCHS``; ``config_overrides`` win over every default."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    config_cls, model_cls, arch_defaults = ARCHS[arch]
    kwargs = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 3 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        # Explicit everywhere: Qwen3 and GLM-4 default head_dim to 128, not hidden / heads.
        "head_dim": hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        # Ten times HF's usual 0.02: the random model then gives varied, decisive greedy output.
        "initializer_range": 0.2,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": dtype,
        **arch_defaults,
        **config_overrides,
    }
    config = config_cls(**kwargs)
    config.architectures = [model_cls.__name__]
    return config


# A larger output projection makes the logits peaked (median top-1/top-2 gap ~0.8), so greedy
# argmax survives float noise between kernels, while the inner weights stay small enough that the
# attention softmax is not saturated (a saturated one would hide attention bugs).
LM_HEAD_GAIN = 2.5


def _randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    """Deterministic weights, including non-default norm weights and biases.

    Hugging Face initialises norms to 1 and biases to 0; random values here make an engine that
    forgets a bias or a norm weight produce different tokens, so the tests can catch it.
    Parameters are drawn in name order from one generator, independent of HF's init order, then the
    learned buffers (GLM-4.5's router bias, zero at init), so that the choice of experts depends on it.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.startswith("lm_head"):  # absent when tied: a scaled input embedding
                # would dominate the residual stream and make the output repetitive
                param.copy_(LM_HEAD_GAIN * std * noise)
            else:
                param.copy_(std * noise)
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # of the order of the sigmoid scores' spread
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen, dtype=torch.float32))


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **config_overrides,
) -> Path:
    """Build a random tiny model plus tokenizer into ``path`` (created if needed); returns ``path``.

    ``vocab_size`` defaults to the tokenizer's size; a larger one adds embedding rows that the
    tokenizer never produces (as real checkpoints pad their vocabularies).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(path, model_max_length=max_position_embeddings)
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)}")
    config = make_config(
        arch,
        vocab_size=vocab_size or len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        **config_overrides,
    )
    with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG: hide that
        model = ARCHS[arch][1](config)
    _randomize(model, config.initializer_range, seed)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(str(path))
    return path


def ensure_tiny_model(cache_dir: str | Path, name: str = "xinserve-tiny", **kwargs) -> Path:
    """``cache_dir/name``, built with ``make_tiny_model(**kwargs)`` on first use and reused after.

    The name identifies the model: a later call with other ``kwargs`` gets the cached one. The
    build happens in a temporary sibling directory renamed into place, so a crash never leaves a
    half-written model and concurrent callers (several workers starting) all see a complete one.
    """
    cache_dir = Path(cache_dir)
    target = cache_dir / name
    if target.is_dir():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache_dir))
    try:
        make_tiny_model(staging, **kwargs)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():  # not a lost race with another builder: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
