"""Tiny random pooling models built offline, shared by the engine and server tests: a
Qwen3-Embedding-shaped sentence-transformers directory, a Qwen3ForSequenceClassification and a
Qwen3-Reranker-shaped causal LM whose tokenizer holds the "yes" / "no" tokens."""

import json
import warnings
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3ForSequenceClassification

from xinserve.server.embedded_model.factory import _randomize, make_config, make_tiny_model

# sentence-transformers 6 renders a tokenizer's chat template around every input unless the module
# is pinned to plain text; Qwen3-Embedding's own directory encodes raw text.
_TEXT_ONLY = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}


def make_embedding_model(path: Path, pooling: str = "lasttoken", normalize: bool = True,
                         matryoshka: list[int] | bool | None = None) -> Path:
    """A Qwen3 base saved by sentence-transformers (modules.json, 1_Pooling, 2_Normalize): ``path``/st."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    base = make_tiny_model(path / "base", "qwen3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = Transformer(str(base), modality_config=_TEXT_ONLY, module_output_name="token_embeddings")
        modules = [module, Pooling(module.get_embedding_dimension(), pooling_mode=pooling)]
        SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu").save(str(path / "st"))
    if matryoshka is not None:
        config_file = path / "st" / "config.json"
        config = json.loads(config_file.read_text())
        config.update({"matryoshka_dimensions": matryoshka} if isinstance(matryoshka, list) else {"is_matryoshka": True})
        config_file.write_text(json.dumps(config))
    return path / "st"


def make_classifier(path: Path, num_labels: int = 3) -> Path:
    """A random Qwen3ForSequenceClassification (its ``score`` head) with the tiny tokenizer."""
    make_tiny_model(path, "qwen3")  # the tokenizer and generation config; the weights are replaced below
    config = make_config("qwen3", vocab_size=1000, num_labels=num_labels, pad_token_id=2, bos_token_id=0,
                         eos_token_id=1, dtype=torch.float32)
    config.architectures = ["Qwen3ForSequenceClassification"]
    with torch.random.fork_rng(devices=[]):
        model = Qwen3ForSequenceClassification(config)
    _randomize(model, config.initializer_range, seed=1)
    for old in path.glob("model*.safetensors"):
        old.unlink()
    model.save_pretrained(str(path))
    return path


def make_reranker(path: Path) -> Path:
    """A Qwen3ForCausalLM whose vocabulary has room for the "yes" and "no" tokens added to its tokenizer."""
    make_tiny_model(path, "qwen3", vocab_size=1024)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["yes", "no"])
    tokenizer.save_pretrained(path)
    return path
