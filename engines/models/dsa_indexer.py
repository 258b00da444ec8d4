"""The DSA ("DeepSeek sparse attention") indexer of DeepSeek-V3.2 and GLM-5: a light attention-like
scorer that picks, for every query token, the ``index_topk`` cached positions its layer's MLA may
attend to.

It has its own paged key cache per layer ([N, BS, index_head_dim], written like the latent) and its
own rotary on the first ``qk_rope_head_dim`` dims of its query heads and key (rotate-half in
DeepSeek-V3.2, interleaved pairs in GLM-5). transformers skips the reference implementation's
Hadamard rotation and FP8 scoring (the rotation keeps dot products; FP8 is a precision shortcut), and
so does this one. Parameter names are the Hugging Face checkpoints' (``self_attn.indexer.*``).
"""

from typing import Any

import torch
from torch import nn

from xinserve.kernels.attention_metadata import AttentionMetadata
from xinserve.kernels.ops import KernelOps

INDEXER_NORM_EPS = 1e-6


class Indexer(nn.Module):
    def __init__(self, config: Any, ops: KernelOps, rope_is_neox: bool) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.topk = config.index_topk
        self.rope_is_neox = rope_is_neox
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)  # float32, as transformers
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        hidden: torch.Tensor,
        q_resid: torch.Tensor,
        index_cache: torch.Tensor,
        metadata: AttentionMetadata,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        """hidden: [T, hidden] (the attention's normed input); q_resid: [T, q_lora_rank] (the MLA's
        normed query latent); cos_sin: the step's rotary table in this indexer's style. Writes this
        step's keys into index_cache [N, BS, Di]; returns the selection [T, K] int64 (-1: none)."""
        num_tokens = hidden.shape[0]
        q = self.wq_b(q_resid).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden)).unsqueeze(1)  # [T, 1, Di]
        # rotary on the first qk_rope_head_dim dims of each head (the table's width), the rest pass
        q, k = self.ops.rotary_embedding(q, k, cos_sin, self.rope_is_neox)
        self.ops.write_latent(k.squeeze(1), index_cache, metadata.slot_mapping)
        # weights: [T, Hi] float32, each head's say in the score
        weights = self.weights_proj(hidden.to(self.weights_proj.weight.dtype)).float() * self.num_heads**-0.5
        return self.ops.indexer_topk(q, weights, index_cache, metadata, self.topk, self.scale)
