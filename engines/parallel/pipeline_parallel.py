"""Pipeline parallelism: contiguous layer ranges per stage, activations passed point-to-point.

A replica of ``tp * pp`` ranks: global rank ``stage * tp + tp_rank``, so with one stage per node a
node holds whole stages. Every rank receives rank 0's step message (engines/parallel/rank_messages.py) and
cuts the same micro-batches from it (engines/parallel/micro_batch.py). Stage 0 embeds micro-batch 1 while
stage 1 runs micro-batch 0: two micro-batches are in flight. Each stage sends its (hidden,
residual) ``[2, t, hidden]`` to the same tp rank of the next stage; the last stage applies the final
norm and sends the hidden states ``[t, hidden]`` back to stage 0, which computes the logits (it
holds the LM head, and the embedding a tied head reuses) and samples on rank 0 as without a
pipeline. Per step and micro-batch: one send and one receive per stage boundary, one back.

Within a stage, tensor parallelism (and expert parallelism) runs over the stage's own process
group (``StageGroup``); ``pp == 1`` keeps the world group as it was.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from xinserve.engines.models.expert_parallel import ExpertPlacement
from xinserve.engines.parallel.distributed import GroupFailure, ParallelGroup
from xinserve.engines.parallel.micro_batch import micro_batches
from xinserve.engines.parallel.rank_role import RankRole
from xinserve.kernels.attention_metadata import AttentionMetadata

MICRO_BATCHES = 2


@dataclass(frozen=True, slots=True)
class StageLayout:
    """Where rank ``rank`` of a ``tp * pp`` replica sits."""

    stage: int
    num_stages: int
    tp_rank: int
    tp: int

    @classmethod
    def of(cls, rank: int, tp: int, pp: int) -> "StageLayout":
        return cls(rank // tp, pp, rank % tp, tp)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    def peer(self, stage: int) -> int:
        """The global rank of this tp rank in ``stage``."""
        return stage * self.tp + self.tp_rank


def stage_layers(num_layers: int, num_stages: int, model: str) -> list[range]:
    """Each stage's contiguous layers, the remainder going to the earlier stages."""
    if num_layers < num_stages:
        raise ValueError(f"model {model}: pipeline_parallel_size {num_stages} does not fit: {num_layers} layers "
                         f"cannot be split over {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (s < extra) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


class StageGroup:
    """The ``Collectives`` of one stage's tensor-parallel ranks: a process group of their own, with
    the world group's counts and failure handling."""

    def __init__(self, world: ParallelGroup, layout: StageLayout, groups: list) -> None:
        self.world, self.rank, self.world_size = world, layout.tp_rank, layout.tp
        self.group = groups[layout.stage]
        self.root = layout.peer(layout.stage) - layout.tp_rank  # global rank of the stage's tp rank 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.world.counts["all_reduce"] += 1
        self.world._checked(dist.all_reduce, x, group=self.group)
        return x

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        self.world.counts["gather"] += 1
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world_size)] if self.rank == 0 else None
        self.world._checked(dist.gather, logits, parts, dst=self.root, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else logits

    def all_to_all(self, output: torch.Tensor, x: torch.Tensor, output_splits: list[int],
                   input_splits: list[int]) -> torch.Tensor:
        self.world.counts["all_to_all"] += 1
        self.world._checked(dist.all_to_all_single, output, x.contiguous(), output_splits, input_splits,
                            group=self.group)
        return output

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.world.counts["all_gather"] += 1
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.world._checked(dist.all_gather, parts, x.contiguous(), group=self.group)
        return parts


def check_pipeline(path: str, pp: int) -> None:
    """Before any rank starts: raise ValueError naming the model at ``path`` when its layers cannot be
    split over ``pp`` stages."""
    if pp == 1:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    name = f"{(getattr(config, 'architectures', None) or [None])[0]} at {path!r}"
    stage_layers(config.num_hidden_layers, pp, name)


def _check_stage_selection(decoder: nn.Module, layers: range, name: str) -> None:
    """A DSA layer without its own indexer reuses the selection of the layer before it (GLM-5's
    "shared" layers): a stage cannot start with one, the selection is not sent between stages."""
    if decoder.has_indexer and layers.start not in decoder.indexer_layers:
        raise ValueError(f"model {name}: pipeline stage layers {layers.start}-{layers.stop - 1} start with a DSA "
                         f"layer that reuses the previous stage's top-k selection; choose another "
                         "pipeline_parallel_size")


def rank_role(rank: int, tp: int, pp: int, model: nn.Module, expert_parallel: bool) -> RankRole:
    """For /health: rank ``rank``'s tp rank, pipeline stage and layers (with a pipeline), and the
    routed experts it holds in each MoE layer (with expert parallelism; the default placement)."""
    layout = StageLayout.of(rank, tp, pp)
    layers = None
    if pp > 1:
        stage = stage_layers(model.config.num_hidden_layers, pp, "")[layout.stage]
        layers = f"{stage.start}-{stage.stop - 1}"
    spec, experts = model.spec(model.config), None
    if expert_parallel and spec.moe_layers:
        experts = ExpertPlacement.contiguous(spec.moe.num_experts, tp).describe(layout.tp_rank)
    return RankRole(layout.tp_rank, layout.stage, experts, layers)


def stage_collectives(world: ParallelGroup, tp: int, pp: int) -> tuple[object | None, "PipelineStage | None"]:
    """This rank's collectives for the layers and its pipeline stage: the world group and no stage
    without a pipeline; else its stage's group (None for one rank per stage) and its stage. Every
    rank creates every stage's group, in the same order (torch.distributed requires it)."""
    if pp == 1:
        return world, None
    layout = StageLayout.of(world.rank, tp, pp)
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)] if tp > 1 else []
    return (StageGroup(world, layout, groups) if tp > 1 else None), PipelineStage(world, layout)


class PipelineStage:
    """Installed on a ``DecoderModel`` (``install``), it runs the model's forward as this stage:
    returns the final hidden states [T, hidden] on stage 0, None on the others."""

    def __init__(self, world: ParallelGroup, layout: StageLayout) -> None:
        self.world, self.layout = world, layout
        self.layers = range(0)
        self.hidden_size = 0

    def install(self, model: nn.Module, name: str) -> None:
        """Keep this stage's layers of ``model`` (a ``CausalLM`` on the meta device): the others become
        empty modules whose checkpoint weights are skipped; the embedding and LM head stay on stage 0,
        the final norm on the last stage. Sizes the KV pool for the local layers."""
        if not hasattr(model.model, "layers"):
            raise ValueError(f"model {name}: pipeline parallelism is not implemented for its layers; run it "
                             f"with pipeline_parallel_size 1")
        decoder, layout = model.model, self.layout
        self.layers = stage_layers(len(decoder.layers), layout.num_stages, name)[layout.stage]
        if hasattr(decoder, "keep_layers"):  # multi-head latent attention: the latent pool of this stage's layers
            _check_stage_selection(decoder, self.layers, name)
            decoder.keep_layers(self.layers)
        absent = [f"model.layers.{i}." for i in range(len(decoder.layers)) if i not in self.layers]
        for i in range(len(decoder.layers)):
            if i not in self.layers:
                decoder.layers[i] = nn.Module()
        if not layout.first:
            decoder.embed_tokens = nn.Module()
            absent.append("model.embed_tokens.")
            if model.lm_head is not None:
                model.lm_head = None
                absent.append("lm_head.")
        if not layout.last:
            decoder.norm = nn.Module()
            absent.append("model.norm.")
        model.absent_weights = tuple(absent)
        model.num_layers = len(self.layers)
        self.hidden_size = model.config.hidden_size
        decoder.pipeline = self

    @torch.inference_mode()
    def __call__(self, decoder: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata, cos_sin_cache: torch.Tensor) -> torch.Tensor | None:
        layout = self.layout
        layers = [decoder.layers[i] for i in self.layers]
        caches = list(decoder.layer_caches(kv_cache))
        size, dtype = self.hidden_size, next(decoder.parameters()).dtype  # the runner's rule, not the KV pool's
        pending, outputs = [], []
        for mb in micro_batches(input_ids, positions, metadata, MICRO_BATCHES):
            t = len(mb.input_ids)
            if layout.first:
                hidden, residual = decoder.embed_tokens(mb.input_ids), None  # [t, hidden]
            else:
                received = torch.empty(2, t, size, dtype=dtype, device=input_ids.device)
                self._recv(received, layout.peer(layout.stage - 1))
                hidden, residual = received[0], received[1]
            step_inputs = decoder.step_inputs(mb.positions, mb.metadata, cos_sin_cache, hidden.dtype)
            for layer, layer_caches in zip(layers, caches):
                hidden, residual = layer(hidden, residual, layer_caches, step_inputs)
            if layout.last:
                hidden, _ = decoder.norm(hidden, residual)
                pending.append(self._send(hidden, layout.peer(0)))
            else:
                pending.append(self._send(torch.stack([hidden, residual]), layout.peer(layout.stage + 1)))
            if layout.first:
                outputs.append(t)
        for work in pending:
            self._wait(work)
        if not layout.first:
            return None
        final = torch.empty(sum(outputs), size, dtype=dtype, device=input_ids.device)
        start = 0
        for t in outputs:  # in micro-batch order, as the last stage sent them
            self._recv(final[start : start + t], layout.peer(layout.num_stages - 1))
            start += t
        return final

    def _send(self, x: torch.Tensor, dst: int) -> tuple:
        """Start sending ``x`` (kept alive with the request until it is waited for)."""
        self.world.counts["send"] += 1
        x = x.contiguous()
        try:
            return dist.isend(x, dst), x
        except RuntimeError as exc:
            raise GroupFailure(f"rank {self.world.rank}: a send to rank {dst} failed (a stage died): {exc}") from exc

    def _recv(self, x: torch.Tensor, src: int) -> None:
        self.world.counts["recv"] += 1
        self.world._checked(dist.recv, x, src)

    def _wait(self, pending: tuple) -> None:
        self.world._checked(pending[0].wait)
