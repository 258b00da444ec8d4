"""Building blocks shared by every decoder model: norms, fused projections, paged attention, MLP.

Each block calls the kernels it is given at construction (``KernelOps``, the kernel registry's
choice for the worker's device; the pure-torch reference by default).
"""

import torch
from torch import nn

from xinserve.kernels.attention_metadata import AttentionMetadata
from xinserve.kernels.ops import REFERENCE_OPS, KernelOps


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: KernelOps = REFERENCE_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.rms_norm = ops.rms_norm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.rms_norm(x, self.weight, self.eps, residual)


class Linear(nn.Linear):
    """An ``nn.Linear`` that multiplies with the kernel registry's ``linear`` (on the CPU, a decode step's
    few rows go through a kernel that streams the cold weight once: kernels/cpu/csrc/decode_linear.cpp).
    It keeps ``ops`` itself, so a kernel built in the background is swapped in (engines/worker/warmup.py).
    ``lora``: the adapter slots of a model served with adapters (engines/lora/stacks.py), which add each
    row's adapter delta to the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: KernelOps = REFERENCE_OPS) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops
        self.lora: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ops.linear(x, self.weight, self.bias)
        return out if self.lora is None else self.lora(x, out)


class MergedLinear(Linear):
    """One Linear standing for several checkpoint projections stacked along the output dim
    (q/k/v, gate/up): one matmul instead of several. ``output_sizes`` tells the loader where
    each checkpoint shard goes."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, ops: KernelOps = REFERENCE_OPS) -> None:
        super().__init__(in_features, sum(output_sizes), bias, ops)
        self.output_sizes = output_sizes


class Attention(nn.Module):
    """Self-attention over the paged KV cache: fused qkv, optional per-head q/k RMSNorm (Qwen3),
    rotary on the first ``rotary_dim`` dims, decode tokens then prefill tokens, each query seeing
    the last ``sliding_window`` positions only when the layer has a window."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None,
        rope_is_neox: bool,
        ops: KernelOps = REFERENCE_OPS,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops
        # Passed to the attention kernels only on windowed layers: kernels without windows take no
        # such keyword (the registry does not choose them for a windowed model).
        self.window = {} if sliding_window is None else {"sliding_window": sliding_window}
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.rope_is_neox = rope_is_neox
        self.qkv_proj = MergedLinear(hidden_size, [self.q_size, self.kv_size, self.kv_size], qkv_bias, ops)
        self.o_proj = Linear(self.q_size, hidden_size, o_bias, ops)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, ops) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, ops) if qk_norm_eps is not None else None

    def forward(
        self,
        hidden: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        cos_sin: torch.Tensor,
    ) -> torch.Tensor:
        """``cos_sin``: the step's ``ops.rotary_cos_sin``, built once for all layers."""
        num_tokens = hidden.shape[0]
        # qkv: [T, (H + 2 * KVH) * D]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotary_embedding(q, k, cos_sin, self.rope_is_neox)
        self.ops.write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = self._attend(q, key_cache, value_cache, metadata)  # [T, H, D]
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _attend(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_decode = metadata.num_decode_seqs
        if not metadata.num_prefill_seqs:  # a pure decode step: no slicing
            return self.ops.paged_decode_attention(
                q, key_cache, value_cache, metadata.block_tables, metadata.seq_lens, self.scale,
                metadata.decode_gather, **self.window,
            )
        prefill = self.ops.paged_prefill_attention(
            q[num_decode:], key_cache, value_cache, metadata.block_tables[num_decode:],
            metadata.prefill_query_start_loc, metadata.prefill_seq_lens, self.scale, **self.window,
        )
        if not num_decode:
            return prefill
        decode = self.ops.paged_decode_attention(
            q[:num_decode], key_cache, value_cache, metadata.block_tables[:num_decode],
            metadata.seq_lens[:num_decode], self.scale, metadata.decode_gather, **self.window,
        )
        return torch.cat((decode, prefill), dim=0)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, ops: KernelOps = REFERENCE_OPS) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias, ops)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, ops)
        self.silu_and_mul = ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))
