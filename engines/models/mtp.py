"""The checkpoint's multi-token-prediction (MTP) layer of DeepSeek-V3, GLM-4.5 and GLM-5: one more
decoder layer at ``model.layers.<num_hidden_layers>`` that drafts the token after next.

At position p it reads the target's hidden state h_p (after the final norm, as vLLM feeds it) and the
embedding of the token at p + 1, and its logits predict the token at p + 2:

    x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])        # the concat's order: embedding first
    g = decoder_layer(x) (its residual added back)          # attends over its own KV layer
    logits = head(shared_head.norm(g))

The embedding is zeroed at position 0, as vLLM does. A chain of drafts feeds g back as the next
position's hidden state. The layer has its own KV cache layer in the pool (one more dense layer, or
one more latent segment and, with DSA, indexer segment), so the block manager and the worker's pool
sizing count it through ``kv_bytes_per_token``. ``embed_tokens`` and ``shared_head.head`` are the
layer's own when the checkpoint has them, else the target's.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from xinserve.engines.models.decoder import DecoderLayer, dense_attention
from xinserve.engines.models.dsa_indexer import Indexer
from xinserve.engines.models.layers import RMSNorm
from xinserve.engines.models.mla import MLAAttention
from xinserve.kernels.ops import KernelOps

# checkpoint components of the MTP layer outside its decoder layer
OWN_PARTS = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


class MultiTokenPredictor(nn.Module):
    def __init__(self, config: Any, block: DecoderLayer, ops: KernelOps, own_embed: bool, own_head: bool) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps, ops)
        self.hnorm = RMSNorm(hidden, eps, ops)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps, ops)
        self.shared_head.head = nn.Linear(hidden, config.vocab_size, bias=False) if own_head else None
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embed else None
        self.block = block
        # Tensor parallel: [N, V / tp] -> [N, V] on every rank (engines/models/tensor_parallel.py)
        self.logits_gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                caches: tuple, step_inputs: tuple, target_embed: nn.Embedding) -> torch.Tensor:
        """input_ids, positions: [T]; previous_hidden: [T, hidden] (the target's, or this layer's own
        output at the position before). Returns g: [T, hidden], before ``shared_head.norm``."""
        embed = (self.embed_tokens or target_embed)(input_ids)  # [T, hidden]
        embed = embed.masked_fill((positions == 0).unsqueeze(1), 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embed), self.hnorm(previous_hidden)], dim=-1))
        hidden, residual = self.block(x, None, caches, step_inputs)
        return hidden + residual

    def compute_logits(self, hidden: torch.Tensor, target_head: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (``forward``'s) -> [N, vocab] float32; ``target_head``: the target's
        output matrix, used when the checkpoint has no ``shared_head.head``."""
        head = target_head if self.shared_head.head is None else self.shared_head.head.weight
        logits = nn.functional.linear(self.shared_head.norm(hidden), head).float()
        return logits if self.logits_gather is None else self.logits_gather(logits)


def mtp_parameter_name(name: str, num_layers: int) -> str | None:
    """A checkpoint name of the MTP layer (``model.layers.<num_layers>.*``) -> ours under ``mtp``
    (``mtp.enorm...``, ``mtp.block.self_attn...``); None for any other name."""
    prefix = f"model.layers.{num_layers}."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    return f"mtp.{rest}" if rest.split(".")[0] in OWN_PARTS else f"mtp.block.{rest}"


def attach_mtp(model: nn.Module, config: Any, ops: KernelOps, checkpoint_names: set[str], name: str) -> None:
    """Give ``model`` (a ``CausalLM`` or ``MLACausalLM``, still on the meta device) its MTP layer as
    ``model.mtp``, shaped as the checkpoint's ``model.layers.<num_hidden_layers>.*`` weights say, and
    one more KV layer. Raises ValueError when the config or the checkpoint has no MTP layer."""
    if (getattr(config, "num_nextn_predict_layers", 0) or 0) < 1:
        raise ValueError(f"{name}: speculative method 'mtp' needs num_nextn_predict_layers >= 1 in config.json; "
                         f"this model has {getattr(config, 'num_nextn_predict_layers', None)}")
    index = config.num_hidden_layers
    names = {n for n in checkpoint_names if mtp_parameter_name(n, index) is not None}
    if f"model.layers.{index}.eh_proj.weight" not in names:
        raise ValueError(f"{name}: speculative method 'mtp' needs the MTP layer's weights "
                         f"(model.layers.{index}.eh_proj.weight ...), which the checkpoint does not have")
    spec = model.spec(config)
    moe_rule = index >= getattr(config, "first_k_dense_replace", 0) and index % (getattr(config, "moe_layer_freq", 1) or 1) == 0
    if spec.moe is not None and moe_rule:  # MoE or dense as the target's own rule says for this index
        spec.moe_layers = spec.moe_layers | {index}
    decoder = model.model
    if hasattr(decoder, "latent_segments"):  # MLA: one more latent segment (and indexer segment) in the pool
        has_indexer = any(".self_attn.indexer." in n for n in names)
        indexer = Indexer(config, ops, decoder.indexer_rope_is_neox) if has_indexer else None
        attention = MLAAttention(config, ops, decoder.rope_is_neox, indexer)
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        decoder.latent_segments.append((decoder.values_per_token, latent))
        decoder.values_per_token += latent
        decoder.index_segments.append((decoder.values_per_token, config.index_head_dim) if has_indexer else None)
        decoder.values_per_token += config.index_head_dim if has_indexer else 0
    else:
        attention = dense_attention(config, spec, model.head_dim, ops)(index)
    block = DecoderLayer(config, spec, ops, index, attention)
    own_embed = f"model.layers.{index}.embed_tokens.weight" in names
    own_head = f"model.layers.{index}.shared_head.head.weight" in names
    model.mtp = MultiTokenPredictor(config, block, ops, own_embed, own_head)


def mtp_layer_caches(model: nn.Module, kv_cache: torch.Tensor) -> tuple:
    """The MTP layer's views of the pool: the last of the model's per-layer caches."""
    return list(model.model.layer_caches(kv_cache))[-1]
