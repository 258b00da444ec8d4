"""The embedded default model written directly: the same files as ``factory.make_tiny_model(path)`` (a
Llama), byte for byte (tests/server/embedded_model/test_embedded_model.py compares them), without importing any
transformers model class. Building the model class, the way ``factory.py`` does, imports ~10 CPU
seconds of modelling code; this writes the weights from their names and shapes and takes well under
one, so a server builds its embedded model in-process on first start."""

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig

from xinserve.server.embedded_model.tokenizer import make_tokenizer
from xinserve.server.embedded_model.weights import config_kwargs, initial_value

ARCHITECTURE = "LlamaForCausalLM"


def llama_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, as ``LlamaForCausalLM`` names them (no biases, untied head)."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_rows, kv_rows = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (q_rows, hidden),
            prefix + "self_attn.k_proj.weight": (kv_rows, hidden),
            prefix + "self_attn.v_proj.weight": (kv_rows, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, q_rows),
            prefix + "mlp.gate_proj.weight": (inter, hidden),
            prefix + "mlp.up_proj.weight": (inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
        }
    return shapes


def write_llama(path: str | Path, seed: int = 0, max_position_embeddings: int = 2048) -> Path:
    """Write the default tiny Llama (``make_tiny_model``'s defaults) and its tokenizer into ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(path, model_max_length=max_position_embeddings)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    config = LlamaConfig(**config_kwargs(vocab_size=len(tokenizer), max_position_embeddings=max_position_embeddings,
                                         **ids))
    config.architectures = [ARCHITECTURE]
    config.save_pretrained(str(path))
    GenerationConfig(**ids).save_pretrained(str(path))
    # Drawn in name order from one generator, as factory._randomize draws a model's parameters.
    gen = torch.Generator().manual_seed(seed)
    weights = {name: initial_value(name, shape, gen, config.initializer_range)
               for name, shape in sorted(llama_shapes(config).items())}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
