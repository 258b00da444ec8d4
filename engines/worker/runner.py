"""Runs one scheduled step on the device: flatten the batch, one forward, one sample, one copy back."""

import logging
import threading
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from xinserve.engines.config import EngineConfig
from xinserve.engines.core.capacity import pool_blocks
from xinserve.engines.core.outputs import TokenLogprob
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.scheduler import SampledTokens, ScheduledSeq
from xinserve.engines.core.sequence import Sequence, needs_prompt_logits
from xinserve.engines.lora.device_adapters import DeviceAdapters
from xinserve.engines.model_loader import load_model, parse_dtype
from xinserve.engines.models.tensor_parallel import Collectives
from xinserve.engines.parallel.pipeline_parallel import PipelineStage
from xinserve.engines.platforms import Platform
from xinserve.engines.speculative.verify import verify_drafts
from xinserve.engines.structured.bitmask import apply_grammars
from xinserve.engines.worker.decode_buckets import max_decode_rows
from xinserve.engines.worker.graphs import (
    DecodeGraphs,
    build_decode_graphs,
    capture_memory_probe,
    effective_mode,
)
from xinserve.engines.worker.sampler import Sampler, SamplingRow, choice_seed
from xinserve.engines.worker.step_inputs import StepBatch, StepInputs, to_device
from xinserve.kernels.cpu.huge_pages import kv_pool
from xinserve.kernels.ep_dispatch import choose_ep_dispatch
from xinserve.kernels.kv_quant import storage_dtype
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.ops import KernelOps
from xinserve.kernels.registry import KernelSelection, select

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, platform: Platform, block_size: int, eos_token_ids: list[int],
        group: Collectives | None = None,  # tensor parallel: this rank's group (engines/parallel/tp_runner.py)
        pipeline: PipelineStage | None = None,  # pipeline parallel: this rank's stage
    ) -> None:
        self.platform = platform
        self.device = platform.device
        self.block_size = block_size
        # A C++ kernel not built yet is built after the engine is ready (engines/worker/warmup.py), on one
        # device that builds in the background (the CPU).
        self.defer_builds = (config.warm_up_in_background and platform.builds_kernels_in_background
                             and not (group or pipeline))
        self.step_lock = threading.Lock()  # held by a step: the warm-up swaps kernels and buckets in between
        self.model, self.hf_config = load_model(
            config.model, parse_dtype(config.dtype), self.device, partial(self._choose_kernels, config),
            group, expert_parallel=config.enable_expert_parallel, pipeline=pipeline, quantization=config.quantization,
            choose_ep_exchange=partial(self._choose_ep_exchange, config), mtp=config.uses_mtp,
            convert=config.convert if config.runner == "pooling" else None)
        self.dtype = next(self.model.parameters()).dtype
        # Only pipeline stage 0 computes logits (it holds the LM head).
        self.computes_logits = pipeline is None or pipeline.layout.first
        self.vocab_size = self.hf_config.vocab_size if not self.computes_logits else self.model.compute_logits(
            torch.zeros(1, self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        ).shape[-1]
        self.sampler = Sampler(self.kernels.ops.top_k_top_p)
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> generator of a seeded sequence
        # seq_id -> log-probs of the prompt tokens computed so far (echo with logprobs; chunked prefill)
        self.prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}
        self.eos_token_ids = eos_token_ids  # suppressed until a sequence has min_tokens
        torch.manual_seed(config.seed)
        self.kv_cache = torch.empty(0)
        # Pure-decode steps in padded buckets, compiled or graph-captured (engines/worker/graphs.py).
        self.compile_mode = effective_mode(config.compile)
        if (group is not None or pipeline is not None) and self.compile_mode != "off":
            # Compiling or capturing across the group's collectives is not built or tested yet.
            logger.info("tensor parallel: decode steps run eagerly (compile %r is ignored)", self.compile_mode)
            self.compile_mode = "off"
        if self.compile_mode != "off" and platform.captures_graphs and self.kernels.uncapturable:
            logger.info("%s decodes eagerly on %s: its kernels cannot be graph-captured yet (%s)",
                        type(self.model).__name__, self.device,
                        ", ".join(f"{op}={name}" for op, name in self.kernels.uncapturable.items()))
            self.compile_mode = "off"
        self.decode_graphs: DecodeGraphs | None = None
        self.max_decode_rows = max_decode_rows(config)  # the largest decode bucket
        self.scratch_block = 0  # the KV block past the pool where padded decode rows write
        # LoRA: every served projection's adapter slots and the step's per-row slots (engines/lora/)
        self.lora = None if not config.enable_lora else DeviceAdapters(
            self.model, config.max_loras, config.max_lora_rank,
            max(config.max_num_batched_tokens, self.max_decode_rows), self.kernels.ops)
        if self.lora is not None and self.lora.serves_experts and platform.captures_graphs:
            logger.info("%s decodes eagerly on %s: LoRA on its routed experts cannot be graph-captured yet",
                        type(self.model).__name__, self.device)
            self.compile_mode = "off"
        self.inputs = StepInputs(block_size, self.device, config.enable_lora)  # builds each step's StepBatch

    def _choose_kernels(self, config: EngineConfig, shapes: ModelShapes, dtype: torch.dtype) -> KernelOps:
        """Probe this device's kernel candidates for the model's shapes (kernels/registry.py)."""
        if dtype not in self.platform.dtypes:
            raise ValueError(f"{self.device} cannot compute in {dtype}; supported: "
                             f"{', '.join(str(d).removeprefix('torch.') for d in self.platform.dtypes)}")
        self.kv_dtype = storage_dtype(config.kv_cache_dtype, dtype)  # the KV pool's (kernels/kv_quant.py)
        shapes = replace(shapes, block_size=self.block_size, kv_cache_dtype=self.kv_dtype,
                         max_lora_rank=config.max_lora_rank if config.enable_lora else 0,
                         max_loras=config.max_loras if config.enable_lora else 0)
        self.kernel_request = (shapes, dtype, config.kernels)  # the warm-up selects again once its builds are done
        self.kernels: KernelSelection = select(self.platform.kernel_preference, self.device, dtype, shapes, config.kernels, self.defer_builds)
        logger.info("kernels on %s (%s):\n%s", self.device, str(dtype).removeprefix("torch."), self.kernels.table())
        return self.kernels.ops

    def _choose_ep_exchange(self, config: EngineConfig, shapes: ModelShapes, dtype: torch.dtype) -> str:
        """Expert parallel's token exchange (kernels/ep_dispatch.py), reported as the op ``ep_dispatch``."""
        return choose_ep_dispatch(self.platform.ep_dispatch_preference, config.tensor_parallel_size, shapes, dtype,
                                  config.max_num_batched_tokens).record(self.kernels)

    def bytes_per_block(self) -> int:
        return self.block_size * self.model.kv_bytes_per_token(self.kv_dtype)  # the model's cache spec

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.scratch_block = num_blocks  # one block more than the block manager hands out
        # The model says the shape (dense: [2, layers, blocks, block_size, kv_heads, head_dim]); a layer gets a view.
        shape = self.model.kv_cache_shape(num_blocks + 1, self.block_size, self.kv_dtype)
        self.kv_cache = kv_pool(shape, self.kv_dtype, self.device)  # huge pages on the CPU (kernels/cpu/huge_pages.py)

    def profile_num_blocks(
        self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, fraction: float
    ) -> int:
        """Run a warm-up step at the largest batch the scheduler can form, then give ``fraction``
        of the free memory left to KV blocks, so no accepted batch can run out of memory later.

        No sequence is longer than ``max_model_len`` (the rotary table ends there), so with few
        sequences the batch holds fewer than ``max_num_batched_tokens`` tokens, as a real one would.
        """
        num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
        num_tokens = min(max_num_batched_tokens, num_seqs * max_model_len)
        base, extra = divmod(num_tokens, num_seqs)
        lens = [base + 1] * extra + [base] * (num_seqs - extra)  # each at most max_model_len
        blocks_needed = sum(-(-n // self.block_size) for n in lens)
        self.allocate_kv_cache(blocks_needed)
        scheduled: list[ScheduledSeq] = []
        next_block = 0
        for i, n in enumerate(lens):
            seq = Sequence(-1 - i, "warm-up", [0] * n, SamplingParams(temperature=0, max_tokens=1))
            count = -(-n // self.block_size)
            seq.block_table = list(range(next_block, next_block + count))
            next_block += count
            scheduled.append(ScheduledSeq(seq, n))
        self.execute(scheduled)
        self.platform.synchronize()
        # Decode graphs are captured after the pool is allocated: hold one of the largest bucket
        # while the free memory is read, so the pool leaves room for them.
        probe = capture_memory_probe(self.model, self.kv_cache, self.platform, self.compile_mode,
                                     self.max_decode_rows, max_model_len, self.block_size, self.scratch_block,
                                     capture_hooks=self.kernels.capture_hooks)
        num_blocks = self.blocks_that_fit(fraction)
        del probe
        return num_blocks

    def blocks_that_fit(self, fraction: float) -> int:
        """After the warm-up step, its pool still allocated: the KV blocks ``fraction`` of the free
        memory holds, one fewer for the scratch block ``allocate_kv_cache`` adds. Frees the warm-up
        pool. (Every rank of a tensor-parallel group measures itself this way.)"""
        self.platform.synchronize()
        free = self.platform.free_memory()
        self.kv_cache = torch.empty(0)
        return pool_blocks(free, fraction, self.bytes_per_block())  # the rule `xinserve plan` sizes by

    def init_decode_graphs(self, max_model_len: int) -> None:
        """Capture the decode buckets over the allocated KV cache (once, at start-up), or set up their
        compiler on the CPU (engines/worker/warmup.py compiles them)."""
        self.decode_graphs = build_decode_graphs(self.model, self.kv_cache, self.platform, self.compile_mode,
                                                 self.max_decode_rows, max_model_len, self.block_size, self.scratch_block,
                                                 capture_hooks=self.kernels.capture_hooks)

    def close(self) -> None:
        """Release what outlives the runner (a tensor-parallel runner's other ranks); here nothing."""

    def load_lora(self, adapter_id: int, path: str) -> None:
        """Read the adapter at ``path`` into its host copy (engines/lora/registry.py says when)."""
        self.lora.load(adapter_id, path)

    def drop_lora(self, adapter_id: int) -> None:
        self.lora.drop(adapter_id)

    def apply_lora(self, batch: StepBatch) -> None:
        """Before a step's forward: its adapters in their device slots, its rows' slots in the layers' buffer."""
        if self.lora is not None:
            self.lora.apply(batch.lora_pairs, batch.lora_slots)

    def release(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)
        self.prompt_logprobs.pop(seq.seq_id, None)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> list[SampledTokens]:
        """One step: its inputs, the forward (and the logits), one sample per sequence that reaches its end."""
        with self.step_lock:
            # A step a decode bucket runs never reads the gather plan: the eager path adds it (``forward``).
            batch = self._prepare(scheduled, with_gather=self.decode_graphs is None)
            self.broadcast(batch)
            if batch.needs_prompt_logits:
                return self._with_prompt_logprobs(batch)
            return self._sample(batch, self.forward(batch))

    def broadcast(self, batch: StepBatch) -> None:
        """Hand the step's inputs to the other ranks before the forward (tensor parallel,
        engines/parallel/tp_runner.py); one device has none."""

    def _sample(self, batch: StepBatch, logits: torch.Tensor | None) -> list[SampledTokens]:
        if logits is None:
            return []
        if batch.drafts:
            rows = [self._sampling_row(seq) for seq in batch.sampled]
            return verify_drafts(logits, batch.sampled, batch.drafts, rows, self.sampler.top_k_top_p)
        if all(_plain_greedy(seq) for seq in batch.sampled):
            # The all-greedy fast path: one argmax (over the grammar masks of constrained rows), no
            # per-row sampling settings, one copy back.
            grammars = [seq.grammar for seq in batch.sampled]
            if any(g is not None for g in grammars):
                logits = apply_grammars(logits, grammars)
            token_ids = logits.argmax(dim=-1).tolist()
            return [SampledTokens(s, [t]) for s, t in zip(batch.sampled, token_ids)]
        out = self.sampler(logits, [self._sampling_row(seq) for seq in batch.sampled])
        token_ids = out.token_ids.tolist()  # the step's one device -> host copy (plus log-probs if asked)
        logprobs: list[list[TokenLogprob] | None] = [None] * len(token_ids)
        if out.logprobs is not None:
            values, ids = out.logprobs.tolist(), out.logprob_token_ids.tolist()
            for i, seq in enumerate(batch.sampled):
                k = seq.params.logprobs
                if k is not None:
                    logprobs[i] = [TokenLogprob(values[i][0], ids[i][1 : 1 + k], values[i][1 : 1 + k])]
        return [SampledTokens(s, [t], lp) for s, t, lp in zip(batch.sampled, token_ids, logprobs)]

    def _with_prompt_logprobs(self, batch: StepBatch) -> list[SampledTokens]:
        """``execute`` for a step in which a sequence asked for its prompt's log-probs (echo with
        logprobs): the logits of its prompt positions too. Off the normal path, with a second copy
        to the host for those log-probs."""
        self.inputs.plan_gather(batch)
        self.apply_lora(batch)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.metadata)  # [T, hidden]
        for seq, start, first_row, count in batch.spans():
            if needs_prompt_logits(seq):
                self._add_prompt_logprobs(seq, start, hidden[first_row : first_row + count])
        logits = None
        if batch.sampled:
            if batch.logits_indices is not None:
                hidden = hidden.index_select(0, batch.logits_indices)
            logits = self.model.compute_logits(hidden)
        sampled = self._sample(batch, logits)
        for token in sampled:
            token.prompt_logprobs = self.prompt_logprobs.pop(token.seq.seq_id, None)
        return sampled

    def _add_prompt_logprobs(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """Log-probs of the prompt tokens that the rows of ``hidden`` ([n, hidden], the positions from
        ``start`` on) predict: row j predicts the token at ``start + j + 1``."""
        entries = self.prompt_logprobs.setdefault(seq.seq_id, [])
        if start == 0:
            entries[:] = [None]  # the first prompt token has nothing before it (and a recompute restarts)
        # The last prompt position predicts the first output token, not a prompt token.
        targets = seq.token_ids[start + 1 : min(start + 1 + hidden.shape[0], seq.num_prompt_tokens)]
        if not targets:
            return
        logprobs = self.model.compute_logits(hidden[: len(targets)]).float().log_softmax(dim=-1)  # [R, V]
        target_ids = torch.tensor(targets, dtype=torch.int64, device=logprobs.device).unsqueeze(1)  # [R, 1]
        values, ids = logprobs.gather(1, target_ids), target_ids
        k = seq.params.prompt_logprobs
        if k:
            top_values, top_ids = logprobs.topk(k, dim=-1)  # [R, k]
            values, ids = torch.cat([values, top_values], dim=1), torch.cat([ids, top_ids], dim=1)
        for row_values, row_ids in zip(values.tolist(), ids.tolist()):
            entries.append(TokenLogprob(row_values[0], row_ids[1:], row_values[1:]))

    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """The model forward plus the logits of the sampled tokens ([N, vocab] float32; None when no
        sequence reaches its end this step)."""
        self.apply_lora(batch)
        if self.decode_graphs is not None and not batch.metadata.num_prefill_seqs and batch.sampled:
            logits = self.decode_graphs.run(batch.input_ids, batch.positions, batch.metadata, batch.host.seq_lens,
                                            batch.logits_indices, verifies=bool(batch.drafts))
            if logits is not None:
                return logits
        self.inputs.plan_gather(batch)  # an eager step reads it
        hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.metadata)  # [T, hidden]
        if not batch.sampled:
            return None
        if batch.logits_indices is not None:
            hidden = hidden.index_select(0, batch.logits_indices)
        return self.model.compute_logits(hidden)

    def _prepare(self, scheduled: list[ScheduledSeq], with_gather: bool = True) -> StepBatch:
        """The step's inputs, decode-first (engines/worker/step_inputs.py)."""
        return self.inputs.prepare(scheduled, with_gather)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = self.generators.get(seq.seq_id)
            if generator is None:
                # Each choice of an n > 1 request gets its own stream; choice 0 matches n = 1.
                generator = torch.Generator(self.device).manual_seed(choice_seed(params.seed, seq.index))
                self.generators[seq.seq_id] = generator
        needs_history = params.has_penalties
        suppress: list[int] = []
        # A grammar decides where a constrained output ends; suppressing its end would mask every token.
        if seq.num_output_tokens < params.min_tokens and seq.grammar is None:
            suppress = [*self.eos_token_ids, *params.stop_token_ids]
        return SamplingRow(
            params=params,
            prompt_token_ids=seq.prompt_token_ids if needs_history else [],
            output_token_ids=seq.output_token_ids if needs_history else [],
            generator=generator,
            suppress_token_ids=suppress,
            grammar=seq.grammar,
        )


def _plain_greedy(seq: Sequence) -> bool:
    """Greedy with nothing that changes the logits (but a grammar mask) or asks for more than the token."""
    p = seq.params
    return (
        p.greedy and p.logprobs is None and not p.has_penalties and seq.num_output_tokens >= p.min_tokens
        and not p.logit_bias
    )


def always_plain_greedy(params: SamplingParams) -> bool:
    """Whether every sequence of these params is ``_plain_greedy`` from its first token (no min_tokens)."""
    return (params.greedy and params.logprobs is None and not params.has_penalties and not params.logit_bias
            and params.min_tokens <= 0)

