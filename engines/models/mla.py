"""Multi-head latent attention (DeepSeek-V2/V3, DeepSeek-V3.2, GLM-5) over the paged latent cache.

Per token the cache holds the normalised compressed key/value ``c`` (R = kv_lora_rank values) and
the rotated key shared by every head (dr = qk_rope_head_dim), not per-head keys and values. Head h's
key is ``[W_UK[h] c, k_rope]`` and its value ``W_UV[h] c``, with ``kv_b_proj`` = [W_UK; W_UV] per head.

- Prefill (and chunked prefill) tokens up-project their sequence's cached latents to per-head keys
  and values and run causal attention over the cached prefix plus the new tokens.
- Decode tokens absorb ``W_UK`` into the query (``q_nope W_UK[h]`` is an R-vector) and attend over
  the latents themselves, then apply ``W_UV`` to the attended latent: no per-head key or value of
  the context is ever built, which is what makes MLA decode cheap.

With a DSA indexer (``engines/models/dsa_indexer.py``) both forms see only the positions it selects.
Parameter names are the Hugging Face checkpoints'.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from xinserve.engines.models.dsa_indexer import Indexer
from xinserve.engines.models.layers import RMSNorm
from xinserve.engines.models.rope import rope_settings, yarn_mscale
from xinserve.kernels.attention_metadata import AttentionMetadata
from xinserve.kernels.ops import KernelOps

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps


def mla_softmax_scale(config: Any) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under a scaled rotary that sets
    ``mscale_all_dim`` (DeepSeek-V3's YaRN configs), as transformers scales it."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = rope_settings(config)
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


@dataclass
class MLAStep:
    """What every MLA layer of one step shares: the metadata, the attention's and the indexer's
    rotations, and the DSA selection of the last layer with an indexer (None before it, and in a
    model without DSA), which a layer without its own indexer attends over."""

    metadata: AttentionMetadata
    cos_sin: torch.Tensor
    index_cos_sin: torch.Tensor
    selected: torch.Tensor | None = None


class MLAAttention(nn.Module):
    def __init__(self, config: Any, ops: KernelOps, rope_is_neox: bool, indexer: Indexer | None) -> None:
        super().__init__()
        self.ops = ops
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, ops)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.indexer = indexer
        self.rope_is_neox = rope_is_neox
        self.scale = mla_softmax_scale(config)

    def forward(
        self, hidden: torch.Tensor, latent_cache: torch.Tensor, index_cache: torch.Tensor | None, step: MLAStep
    ) -> torch.Tensor:
        """hidden: [T, hidden]; latent_cache: [N, BS, R + dr]; index_cache: [N, BS, Di] on a layer
        with its own indexer, which then sets ``step.selected`` for itself and the layers after it.
        Returns [T, hidden]."""
        metadata, cos_sin = step.metadata, step.cos_sin
        num_tokens = hidden.shape[0]
        q_resid = None
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))  # [T, q_lora_rank], the indexer's input too
            q = self.q_b_proj(q_resid)
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        kv_c, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)  # [T, R]
        # q_rope: [T, H, dr]; k_rope: [T, 1, dr] (one rotary key shared by the heads)
        q_rope, k_rope = self.ops.rotary_embedding(q[..., self.nope_dim :], k_rope.unsqueeze(1), cos_sin,
                                                   self.rope_is_neox)
        self.ops.write_latent(torch.cat((kv_c, k_rope.squeeze(1)), dim=-1), latent_cache, metadata.slot_mapping)
        if self.indexer is not None:
            step.selected = self.indexer(hidden, q_resid, index_cache, metadata, step.index_cos_sin)  # [T, K]
        selected = step.selected
        q_nope = q[..., : self.nope_dim]
        num_decode = metadata.num_decode_seqs
        parts = []
        if num_decode:
            parts.append(self.absorbed_decode(
                q_nope[:num_decode], q_rope[:num_decode], latent_cache, metadata,
                None if selected is None else selected[:num_decode],
            ))
        if metadata.num_prefill_seqs:
            query = torch.cat((q_nope[num_decode:], q_rope[num_decode:]), dim=-1)  # [Tp, H, dn + dr]
            parts.append(self.up_projected_prefill(
                query, latent_cache, metadata, None if selected is None else selected[num_decode:],
            ))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # [T, H, dv]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))

    def _up_weight(self) -> torch.Tensor:
        """kv_b_proj's weight per head: [H, dn + dv, R], W_UK's rows then W_UV's."""
        return self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)

    def absorbed_decode(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent_cache: torch.Tensor,
        metadata: AttentionMetadata,
        selected: torch.Tensor | None,
    ) -> torch.Tensor:
        """q_nope: [S, H, dn], q_rope: [S, H, dr] of S single-token decodes -> [S, H, dv]."""
        weight = self._up_weight()
        w_uk, w_uv = weight[:, : self.nope_dim], weight[:, self.nope_dim :]  # [H, dn, R], [H, dv, R]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [S, H, R]
        query = torch.cat((q_latent, q_rope), dim=-1)  # [S, H, R + dr]
        num_decode = metadata.num_decode_seqs
        attended = self.ops.mla_decode_attention(  # [S, H, R]
            query, latent_cache, self.kv_lora_rank, metadata.block_tables[:num_decode],
            metadata.seq_lens[:num_decode], self.scale, metadata.decode_gather, selected,
        )
        return torch.bmm(attended.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [S, H, dv]

    def up_projected_prefill(
        self, query: torch.Tensor, latent_cache: torch.Tensor, metadata: AttentionMetadata,
        selected: torch.Tensor | None,
    ) -> torch.Tensor:
        """The prefill tokens (P sequences back to back), query [Tp, H, dn + dr] -> [Tp, H, dv]: each
        sequence's cached latents up-projected to per-head keys and values, causal attention."""
        num_decode = metadata.num_decode_seqs
        return self.ops.mla_prefill_attention(
            query, latent_cache, self._up_weight(), metadata.block_tables[num_decode:], metadata.prefill_query_start_loc,
            metadata.prefill_seq_lens, self.scale, selected,
        )
