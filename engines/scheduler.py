"""Continuous batching over one token budget per step. No torch.

There is no prefill phase and no decode phase: each running sequence's ``num_computed_tokens``
catches up with its ``num_tokens`` within the step's token budget, so a long prompt is prefilled in
chunks while other sequences keep decoding in the same step. Running sequences go first (oldest
first); waiting ones are admitted FCFS while budget, sequence slots and blocks last. When blocks
run out the newest running sequence is preempted (its KV is dropped and recomputed later).
After the model ran, ``update`` does the step's bookkeeping: computed tokens, cached blocks, the
sampled tokens appended, stops detected.
"""

import logging
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from engines.kv_cache import BlockManager
from engines.outputs import StepOutput, TokenLogprob
from engines.sequence import Sequence, SequenceStatus, needs_prompt_logits

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class SampledTokens:
    """What one step sampled for one sequence: one token today; a list so that a step that accepts
    several (speculative decoding) hands them over the same way. ``logprobs``: one per token, when asked."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with a request's first token, when asked


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
        eos_token_ids: Collection[int] = (), max_model_len: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = self._schedule_running(scheduled, budget)
        budget -= sum(s.num_new_tokens for s in scheduled)
        if not preempted:
            self._admit_waiting(scheduled, budget)
        return scheduled

    def _schedule_running(self, scheduled: list[ScheduledSeq], budget: int) -> bool:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                self._preempt(self.running.pop())
                preempted = True
                if i == len(self.running):  # the sequence preempted itself: nothing left to run
                    return preempted
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1
        return preempted

    def _admit_waiting(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._waits_for_parent(seq):
                break
            # A prompt whose log-probs are asked for is computed whole: a prefix-cache hit has no logits.
            computed: list[int] = []
            external: list[int] = []  # past the pool's own hits, blocks an external tier holds (loaded)
            if not needs_prompt_logits(seq):
                computed = self.block_manager.computed_blocks(seq)
                external = self.block_manager.external_blocks(seq, computed)
            cached_tokens = (len(computed) + len(external)) * self.block_manager.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - cached_tokens, budget)
            if not self.block_manager.allocate_slots(seq, num_new, computed, external):
                break
            self.block_manager.record_prefix_lookup(seq, computed, external)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    @staticmethod
    def _waits_for_parent(seq: Sequence) -> bool:
        """An extra choice of an n > 1 request starts once its parent's prompt is in the cache,
        so it can share the prompt's blocks instead of computing them again."""
        parent = seq.parent
        return (
            parent is not None
            and parent.status is not SequenceStatus.FINISHED
            and parent.num_computed_tokens < parent.num_prompt_tokens
        )

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, scheduled: list[ScheduledSeq], sampled: list[SampledTokens]) -> list[StepOutput]:
        """After the model ran ``scheduled``: their tokens are computed (full blocks enter the prefix
        cache), each sequence in ``sampled`` takes its new tokens up to the first that stops it, and a
        stopped one is finished. Returns one output per sampled sequence."""
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_full_blocks(s.seq)
        return [self._append(s) for s in sampled]

    def _append(self, sampled: SampledTokens) -> StepOutput:
        seq, accepted, reason, error = sampled.seq, 0, None, None
        for token in sampled.token_ids:
            seq.token_ids.append(token)
            accepted += 1
            if seq.grammar is not None and not seq.grammar.matcher.accept_token(token):
                # The mask allows only tokens the grammar accepts: this is a bug, not a bad request.
                error = f"token {token} is outside the output's grammar"
                logger.error("request %s: %s", seq.request_id, error)
            if seq.waiting_grammar is not None and token == seq.params.json_schema_after_token:
                seq.grammar, seq.waiting_grammar = seq.waiting_grammar, None
            reason = "error" if error else self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                break
        return StepOutput(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=sampled.token_ids[:accepted],
            finished=reason is not None,
            finish_reason=reason,
            logprobs=None if sampled.logprobs is None else sampled.logprobs[:accepted],
            error=error,
            prompt_logprobs=sampled.prompt_logprobs,
        )

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.grammar is not None and token in self.eos_token_ids:
            return "stop"  # the grammar's end: its mask allows EOS only there, ignore_eos or not
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return "length"
        if self.max_model_len is not None and seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) wherever it is, freeing its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
