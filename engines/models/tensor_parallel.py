"""Tensor-parallel layers and the pass that shards a ``CausalLM`` for one rank.

Megatron's split: q/k/v and gate/up are column-parallel (each rank computes its heads and its slice
of the intermediate dim, no communication), o_proj and down_proj row-parallel (each rank's partial
product, summed by one all-reduce), the embedding and the LM head vocabulary-parallel (an
all-reduce of the masked lookups; the logits gathered on rank 0 only). KV heads are split across
the ranks, or replicated when there are fewer KV heads than ranks (rank r then holds KV head
``r * kv_heads // tp``, the one its query heads attend with). Routed experts are split along their
intermediate dim like a dense MLP, their block's output all-reduced once; shared experts are a dense
MLP with its own all-reduce. Multi-head latent attention splits its heads and keeps its latent cache and
DSA indexer whole on every rank (``_shard_mla_attention`` says why).

Each sharded module knows which part of a checkpoint tensor it holds: ``read_shard(piece, leaf,
shard)`` reads exactly that from a safetensors slice (``safe_open(...).get_slice``), so no rank ever
materialises a full q/k/v, MLP, embedding or LM-head weight.
"""

from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from xinserve.engines.models.layers import Attention, GatedMLP, MergedLinear
from xinserve.engines.models.mla import MLAAttention
from xinserve.engines.models.moe import Experts, SparseMoeBlock


class Collectives(Protocol):
    """What the layers need of ``xinserve.engines.parallel.distributed.ParallelGroup``."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor: ...


class Piece(Protocol):
    """A safetensors slice: indexing reads only the selected part of the file."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...

    def get_shape(self) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """Which attention heads rank ``rank`` of ``tp`` holds."""

    num_heads: int  # query heads on this rank
    q_start: int  # its first query head
    num_kv_heads: int  # KV heads on this rank
    kv_start: int  # its first KV head

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, rank: int, tp: int) -> "HeadSplit":
        local_kv = num_kv_heads // tp if num_kv_heads >= tp else 1
        return cls(num_heads // tp, rank * num_heads // tp, local_kv, rank * num_kv_heads // tp)


class ColumnParallelMerged(MergedLinear):
    """This rank's rows of a fused projection: ``ranges[s] = (start, length)`` within checkpoint
    shard ``s`` (q, k, v or gate, up), whose full sizes are ``full_sizes``."""

    def __init__(self, in_features: int, full_sizes: list[int], ranges: list[tuple[int, int]], bias: bool) -> None:
        super().__init__(in_features, [n for _, n in ranges], bias)
        self.full_sizes, self.ranges = full_sizes, ranges

    def read_shard(self, piece: Piece, leaf: str, shard: int | None) -> torch.Tensor:
        if shard is not None:  # a separate checkpoint tensor (q_proj, gate_proj, ...)
            start, length = self.ranges[shard]
            return piece[start : start + length]
        # The checkpoint stores the fused tensor (GLM-4's gate_up_proj): each shard's rows in turn.
        parts, offset = [], 0
        for full, (start, length) in zip(self.full_sizes, self.ranges):
            parts.append(piece[offset + start : offset + start + length])
            offset += full
        return torch.cat(parts)


class RowParallelLinear(nn.Linear):
    """Input columns ``[start, start + in_features)`` of a full projection; the partial products of
    the ranks are summed by one all-reduce, then the (replicated) bias is added once. ``lora``: adapter slots
    whose A holds the same input columns (engines/lora/stacks.py): their partial delta joins the all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, start: int, group: Collectives) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.start, self.group = start, group
        self.lora: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight)
        out = self.group.all_reduce(out if self.lora is None else self.lora(x, out))
        return out if self.bias is None else out + self.bias

    def read_shard(self, piece: Piece, leaf: str, shard: int | None) -> torch.Tensor:
        return piece[:, self.start : self.start + self.in_features] if leaf == "weight" else piece[:]


def _read_vocab_rows(piece: Piece, start: int, rows: int, vocab_size: int) -> torch.Tensor:
    """Rows ``[start, start + rows)`` of a [vocab, hidden] tensor, zero rows past the vocabulary."""
    part = piece[start : min(start + rows, vocab_size)]
    if part.shape[0] == rows:
        return part
    return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])


class ParallelExperts(Experts):
    """Every routed expert's slice ``[start, start + I / tp)`` of its intermediate dim: gate and up
    rows column-parallel, down columns row-parallel (the block's output is all-reduced once)."""

    def __init__(self, num_experts: int, hidden_size: int, full_intermediate: int, rank: int, tp: int,
                 group: Collectives | None = None) -> None:
        super().__init__(num_experts, hidden_size, full_intermediate // tp)
        self.full_intermediate, self.start = full_intermediate, rank * (full_intermediate // tp)
        self.group = group  # what sums the ranks' partial outputs (quantized experts call it themselves)

    def read_shard(self, piece: Piece, leaf: str, shard: int | None) -> torch.Tensor:
        # one expert's [I, Hd] gate or up, [2I, Hd] gate_up or [Hd, I] down; or all experts stacked
        stacked = len(piece.get_shape()) == 3
        lead = (slice(None),) if stacked else ()
        start, local = self.start, self.output_sizes[0]
        if leaf == "down_proj":
            return piece[(*lead, slice(None), slice(start, start + local))]
        if shard is not None:
            return piece[(*lead, slice(start, start + local))]
        gate = piece[(*lead, slice(start, start + local))]
        up = piece[(*lead, slice(self.full_intermediate + start, self.full_intermediate + start + local))]
        return torch.cat([gate, up], dim=len(lead))


def _all_reduced(fused_moe: Any, group: Collectives, *args: Any) -> torch.Tensor:
    """The routed experts' partial sums of this rank, summed over the ranks."""
    return group.all_reduce(fused_moe(*args))


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows)`` of the embedding (the last rank's padded with zeros): tokens of
    other ranks look up zeros here, and one all-reduce adds the ranks' lookups."""

    def __init__(self, vocab_size: int, hidden_size: int, start: int, rows: int, group: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.vocab_size, self.start, self.group = vocab_size, start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start  # [T]
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = nn.functional.embedding(torch.where(mine, local, 0), self.weight)  # [T, hidden]
        return self.group.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))

    def read_shard(self, piece: Piece, leaf: str, shard: int | None) -> torch.Tensor:
        return _read_vocab_rows(piece, self.start, self.weight.shape[0], self.vocab_size)


class VocabParallelLMHead(nn.Linear):
    """Rows ``[start, start + out_features)`` of an untied LM head (zeros past the vocabulary)."""

    def __init__(self, hidden_size: int, vocab_size: int, start: int, rows: int) -> None:
        super().__init__(hidden_size, rows, bias=False)
        self.vocab_size, self.start = vocab_size, start

    def read_shard(self, piece: Piece, leaf: str, shard: int | None) -> torch.Tensor:
        return _read_vocab_rows(piece, self.start, self.out_features, self.vocab_size)


def check_tensor_parallel(config: Any, tp: int, model: str) -> None:
    """Raise ValueError naming ``model`` when it cannot be split over ``tp`` ranks."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if heads % tp:
        problems.append(f"{heads} attention heads do not divide by {tp}")
    # MLA (a kv_lora_rank) caches one latent that every rank replicates: its KV heads are not split
    if kv_heads % tp and tp % kv_heads and getattr(config, "kv_lora_rank", None) is None:
        problems.append(f"{kv_heads} KV heads neither divide by {tp} nor divide it")
    if config.intermediate_size % tp:
        problems.append(f"intermediate_size {config.intermediate_size} does not divide by {tp}")
    if problems:
        raise ValueError(f"model {model}: tensor_parallel_size {tp} does not fit: {'; '.join(problems)}")


def check_model_splits(path: str, tp: int, expert_parallel: bool = False) -> None:
    """Before any rank starts: raise ValueError naming the model at ``path`` when it cannot be split
    over ``tp`` ranks (heads, intermediate size, experts). With ``expert_parallel`` the routed experts
    are placed whole (their count must divide by ``tp``)."""
    from transformers import AutoConfig

    from xinserve.engines.models import MODEL_REGISTRY
    from xinserve.engines.models.expert_parallel import check_expert_parallel

    config = AutoConfig.from_pretrained(path)
    architecture = (getattr(config, "architectures", None) or [None])[0]
    name = f"{architecture} at {path!r}"
    model_cls = MODEL_REGISTRY.get(architecture)
    moe = model_cls.spec(config).moe if model_cls is not None and model_cls.spec(config).moe_layers else None
    check_tensor_parallel(config, tp, name)
    if moe is not None and expert_parallel:
        check_expert_parallel(moe.num_experts, tp, name)
        if moe.shared_intermediate_size % tp:
            raise ValueError(f"model {name}: tensor_parallel_size {tp} does not fit: the shared experts' "
                             f"intermediate size {moe.shared_intermediate_size} does not divide by {tp}")
    elif moe is not None and (moe.intermediate_size % tp or moe.shared_intermediate_size % tp):
        raise ValueError(f"model {name}: tensor_parallel_size {tp} does not fit: the experts' intermediate "
                         f"size {moe.intermediate_size} (shared: {moe.shared_intermediate_size}) does not "
                         f"divide by {tp}")


def shard_model(model: nn.Module, group: Collectives, name: str, expert_parallel: bool = False) -> None:
    """Replace ``model``'s layers with this rank's tensor-parallel shards, in place (on the meta
    device, before the loader allocates it). Sets the model's ``num_kv_heads`` to the local count,
    which sizes the KV pool. Raises ValueError naming ``name`` for a model that cannot be split.
    ``expert_parallel``: routed experts are left whole (engines/models/expert_parallel.py places them)."""
    config, tp, rank = model.config, group.world_size, group.rank  # load_model checked the split
    split = HeadSplit.of(config.num_attention_heads, config.num_key_value_heads, rank, tp)
    mtp = getattr(model, "mtp", None)  # the checkpoint's MTP layer: its decoder layer split as the others
    for layer in [*model.model.layers, *([mtp.block] if mtp is not None else [])]:
        if isinstance(layer.self_attn, Attention):
            _shard_attention(layer.self_attn, split, group)
        else:  # multi-head latent attention: its heads split, its latent (model.num_kv_heads = 1) replicated
            _shard_mla_attention(layer.self_attn, rank, tp, group)
        if isinstance(layer.mlp, GatedMLP):
            _shard_mlp(layer.mlp, rank, tp, group)
        elif isinstance(layer.mlp, SparseMoeBlock) and expert_parallel:
            if layer.mlp.shared_experts is not None:
                _shard_mlp(layer.mlp.shared_experts, rank, tp, group)
        elif isinstance(layer.mlp, SparseMoeBlock):
            _shard_moe(layer.mlp, rank, tp, group, name)
    if isinstance(model.model.layers[0].self_attn, Attention):  # MLA keeps its one latent "head" whole
        model.num_kv_heads = split.num_kv_heads
    vocab, hidden = config.vocab_size, config.hidden_size
    rows = -(-vocab // tp)
    model.model.embed_tokens = VocabParallelEmbedding(vocab, hidden, rank * rows, rows, group)
    if model.lm_head is not None:
        model.lm_head = VocabParallelLMHead(hidden, vocab, rank * rows, rows)
    model.logits_gather = partial(group.gather_logits, vocab_size=vocab)
    if mtp is not None:
        _shard_mtp_vocab(mtp, vocab, hidden, rank * rows, rows, group)


def _shard_mtp_vocab(mtp: nn.Module, vocab: int, hidden: int, start: int, rows: int, group: Collectives) -> None:
    """The MTP layer's own embedding and head (when the checkpoint has them) vocabulary-parallel like the
    target's; ``eh_proj`` and the norms stay whole. Its draft logits are gathered on *every* rank, so each
    rank takes the same argmax and feeds the same draft to the next MTP step (ranks verify the same drafts)."""
    if mtp.embed_tokens is not None:
        mtp.embed_tokens = VocabParallelEmbedding(vocab, hidden, start, rows, group)
    if mtp.shared_head.head is not None:
        mtp.shared_head.head = VocabParallelLMHead(hidden, vocab, start, rows)
    mtp.logits_gather = partial(_all_gathered_logits, group, vocab)


def _all_gathered_logits(group: Any, vocab_size: int, logits: torch.Tensor) -> torch.Tensor:
    """Each rank's [N, V / tp] slice -> [N, vocab_size] on every rank (the last slice's padding dropped)."""
    return torch.cat(group.all_gather(logits), dim=-1)[:, :vocab_size]


def _shard_attention(attn: Attention, split: HeadSplit, group: Collectives) -> None:
    d = attn.head_dim
    full_q, full_kv = attn.q_size, attn.kv_size
    qkv, o = attn.qkv_proj, attn.o_proj
    attn.num_heads, attn.num_kv_heads = split.num_heads, split.num_kv_heads
    attn.q_size, attn.kv_size = split.num_heads * d, split.num_kv_heads * d
    kv_range = (split.kv_start * d, attn.kv_size)
    attn.qkv_proj = ColumnParallelMerged(
        qkv.in_features, [full_q, full_kv, full_kv], [(split.q_start * d, attn.q_size), kv_range, kv_range],
        bias=qkv.bias is not None,
    )
    attn.o_proj = RowParallelLinear(attn.q_size, o.out_features, o.bias is not None, split.q_start * d, group)


def _head_rows(linear: nn.Linear, first_head: int, heads: int, per_head: int) -> ColumnParallelMerged:
    """Rows ``[first_head * per_head, (first_head + heads) * per_head)`` of ``linear`` ([H * per_head, in])."""
    return ColumnParallelMerged(linear.in_features, [linear.out_features], [(first_head * per_head, heads * per_head)],
                                bias=linear.bias is not None)


def _shard_mla_attention(attn: MLAAttention, rank: int, tp: int, group: Collectives) -> None:
    """Multi-head latent attention (DeepSeek-V3/V3.2, GLM-5): H / tp consecutive heads per rank.

    ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` are column-parallel per head (the checkpoint's per-head
    row blocks of dn + dr and dn + dv rows), so prefill's up-projection and decode's absorbed ``W_UK`` /
    ``W_UV`` cover exactly this rank's heads; ``o_proj`` is row-parallel (one all-reduce). The query and
    KV down-projections and their norms stay whole: their outputs are what every head reads. So does
    the latent cache: a cached latent has no head dimension (every head attends over all R + dr values),
    so each rank writes and keeps the same latents, as vLLM does; the KV bytes per token per device do
    not shrink with TP. The DSA indexer stays whole too, with its key cache: it sums its heads' scores
    before the top-k, so a head split would need an all-reduce of a [tokens, context] score matrix per
    indexer layer and a different summation order could pick other positions at a tie; replicated, every
    rank selects the same positions from the same all-reduced inputs, for its small weights (GLM-5:
    about 9M parameters per layer of 9.5B)."""
    heads = attn.num_heads // tp
    first = rank * heads
    qk_dim = attn.nope_dim + attn.rope_dim
    if attn.q_lora_rank is None:
        attn.q_proj = _head_rows(attn.q_proj, first, heads, qk_dim)
    else:
        attn.q_b_proj = _head_rows(attn.q_b_proj, first, heads, qk_dim)
    attn.kv_b_proj = _head_rows(attn.kv_b_proj, first, heads, attn.nope_dim + attn.v_dim)
    o = attn.o_proj
    attn.o_proj = RowParallelLinear(heads * attn.v_dim, o.out_features, o.bias is not None, first * attn.v_dim, group)
    attn.num_heads = heads


def _shard_mlp(mlp: GatedMLP, rank: int, tp: int, group: Collectives) -> None:
    full = mlp.down_proj.in_features
    local = full // tp
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    mlp.gate_up_proj = ColumnParallelMerged(
        gate_up.in_features, [full, full], [(rank * local, local)] * 2, bias=gate_up.bias is not None
    )
    mlp.down_proj = RowParallelLinear(local, down.out_features, down.bias is not None, rank * local, group)


def _shard_moe(block: SparseMoeBlock, rank: int, tp: int, group: Collectives, name: str) -> None:
    """Routed experts split along their intermediate dim (the router stays whole, so every rank picks
    the same experts); shared experts split as a dense MLP. Two all-reduces with shared experts."""
    experts = block.experts
    num_experts, hidden, full = experts.down_proj.shape
    if full % tp:
        raise ValueError(f"model {name}: the experts' intermediate size {full} does not divide by {tp}")
    block.experts = ParallelExperts(num_experts, hidden, full, rank, tp, group)
    block.fused_moe = partial(_all_reduced, block.fused_moe, group)
    if block.shared_experts is not None:
        _shard_mlp(block.shared_experts, rank, tp, group)


def read_shard(model: nn.Module, name: str, piece: Piece) -> torch.Tensor:
    """The part of checkpoint tensor ``name`` that this rank's ``model`` holds (all of it for a
    replicated one: norms, biases of row-parallel layers)."""
    if model._skipped(name):
        return torch.empty(0)
    target, expert, shard = model._target(name)
    module_name, _, leaf = target.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:  # not ours: load_weights names it
        return piece[:]
    if expert is not None and isinstance(module, Experts) and module.slot(expert) is None:
        return torch.empty(0)  # another rank's whole expert (expert parallel): never read
    reader = getattr(module, "read_shard", None)
    return piece[:] if reader is None else reader(piece, leaf, shard)
