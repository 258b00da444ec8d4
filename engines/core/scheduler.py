"""Continuous batching over one token budget per step. No torch.

There is no prefill phase and no decode phase: each running sequence's ``num_computed_tokens``
catches up with its ``num_tokens`` within the step's token budget, so a long prompt is prefilled in
chunks while other sequences keep decoding in the same step. Running sequences go first (oldest
first); waiting ones are admitted FCFS while budget, sequence slots and blocks last. When blocks
run out the newest running sequence is preempted (its KV is dropped and recomputed later).
A decoding sequence with draft tokens (speculative decoding) takes 1 + k rows, the drafts counted in
the budget; when their blocks do not fit, or would leave the sequences after it short, it runs
without them: drafts never cause a preemption.
After the model ran, ``update`` does the step's bookkeeping: computed tokens, cached blocks, the
sampled tokens appended, stops detected; of a drafted sequence only the accepted drafts count as
computed (the rejected ones' slots are rolled back and never reach the prefix cache).
With async scheduling (engines/core/async_scheduling.py) the update comes in two halves: ``commit`` when a
step is launched (its rows count as computed, each sampled sequence gets a ``PLACEHOLDER`` token, so
the next step can be scheduled before this one's tokens are known) and ``resolve`` once they are.
"""

import logging
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from xinserve.engines.core.kv_cache import BlockManager
from xinserve.engines.core.outputs import FinishReason, RequestFailure, StepOutput, StepResult, TokenLogprob
from xinserve.engines.core.sequence import Sequence, SequenceStatus, needs_prompt_logits
from xinserve.engines.speculative.stats import SpecDecodeStats

logger = logging.getLogger(__name__)

PLACEHOLDER = -1  # a token sampled by a step still running (async scheduling); never a vocabulary id


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # rows this step: the drafts included
    draft_token_ids: list[int] = field(default_factory=list)  # run after the sequence's last token


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
        eos_token_ids: Collection[int] = (), max_model_len: int | None = None, kv_connector: Any = None,
        lora_slots: Any = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        self.prompt_tokens_computed = 0  # prompt tokens run through the model (not cached, not loaded)
        # A KV connector (engines/kv/connector.py): tokens it loads at admission, blocks it holds after a
        # request ends (request id -> block ids, until ``release_sent_blocks``), the params it gives back.
        self.kv_connector = kv_connector
        block_manager.counts_external = kv_connector is not None  # its loads are the external prefix hits
        self.held_blocks: dict[str, list[int]] = {}
        self.kv_transfer_params: dict[str, dict[str, Any]] = {}
        # LoRA's device slots (engines/lora/slot_table.py): a sequence with an adapter runs only with a slot
        self.lora_slots = lora_slots

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
            if self._ends_with_pending_token(seq):
                i += 1  # its pending token is its last: it gets no row past it
                continue
            k = self._num_drafts(seq, budget) if seq.draft_token_ids else 0
            if k and self._drafts_fit(seq, k, len(self.running) - i - 1) and self.block_manager.allocate_slots(seq, 1 + k):
                step = ScheduledSeq(seq, 1 + k, seq.draft_token_ids[:k])
            else:
                num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
                while not self.block_manager.allocate_slots(seq, num_new):
                    self._preempt(self.running.pop())
                    preempted = True
                    if i == len(self.running):  # the sequence preempted itself: nothing left to run
                        return preempted
                step = ScheduledSeq(seq, num_new)
            scheduled.append(step)
            budget -= step.num_new_tokens
            i += 1
        return preempted

    def _ends_with_pending_token(self, seq: Sequence) -> bool:
        """Whether ``seq`` ends for certain with its token still being sampled (max_tokens or the context)."""
        if seq.token_ids[-1] != PLACEHOLDER:
            return False
        limit, num_tokens = seq.params.max_tokens, len(seq.token_ids)
        return (limit is not None and num_tokens - seq.num_prompt_tokens >= limit) or (
            self.max_model_len is not None and num_tokens >= self.max_model_len)

    def _drafts_fit(self, seq: Sequence, k: int, num_after: int) -> bool:
        """Drafts never cost another running sequence its step: the blocks they take leave one free
        block for each of the ``num_after`` sequences still to schedule."""
        bm = self.block_manager
        extra = bm.blocks_needed(seq.num_computed_tokens + 1 + k) - len(seq.block_table)
        return bm.num_free_blocks - extra >= num_after

    def _num_drafts(self, seq: Sequence, budget: int) -> int:
        """How many of a decoding sequence's draft tokens fit this step: within the budget (its own
        token first), the context (a draft's position must exist) and what ``max_tokens`` leaves."""
        if not seq.draft_token_ids or seq.num_tokens - seq.num_computed_tokens != 1:
            return 0
        room = min(len(seq.draft_token_ids), budget - 1)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(room, 0)

    def _admit_waiting(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0] if self.lora_slots is None else self._next_with_slot()
            if seq is None:
                break
            if self._waits_for_parent(seq):
                self._drop_slot(seq)
                break
            # A prompt whose log-probs are asked for is computed whole: a prefix-cache hit has no logits.
            computed: list[int] = []
            num_external = 0  # past the pool's own hits, tokens the KV connector loads
            if not needs_prompt_logits(seq):
                computed = self.block_manager.computed_blocks(seq)
                if self.kv_connector is not None:
                    num_external = self.kv_connector.get_num_new_matched_tokens(seq, computed)
            cached_tokens = len(computed) * self.block_manager.block_size + num_external
            num_new = min(seq.num_tokens - seq.num_computed_tokens - cached_tokens, budget)
            if not self.block_manager.allocate_slots(seq, num_external + num_new, computed):
                self._drop_slot(seq)
                break
            if num_external:
                seq.num_computed_tokens += num_external
                self.kv_connector.update_state_after_alloc(seq, seq.block_table[len(computed):], num_external)
            self.block_manager.record_prefix_lookup(seq, computed, external_tokens=num_external)
            if seq is self.waiting[0]:
                self.waiting.popleft()
            else:  # passed sequences whose adapter waits for a slot
                self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _next_with_slot(self) -> Sequence | None:
        """The first waiting sequence that can run: without an adapter, or with its adapter's slot (taken
        now); sequences whose adapter gets no slot wait (engines/lora/slot_table.py)."""
        for seq in self.waiting:
            if seq.lora is None:
                return seq
            slot = self.lora_slots.acquire(seq.lora.adapter_id)
            if slot is not None:
                seq.lora_slot = slot
                return seq
        return None

    def _drop_slot(self, seq: Sequence) -> None:
        """Give back the sequence's adapter slot (it leaves the running set, or was not admitted)."""
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora.adapter_id)
            seq.lora_slot = -1

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
        self._drop_slot(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, scheduled: list[ScheduledSeq], sampled: list[SampledTokens]) -> StepResult:
        """After the model ran ``scheduled``: their tokens are computed (full blocks enter the prefix
        cache), each sequence in ``sampled`` takes its new tokens up to the first that stops it, and a
        stopped one is finished. Returns one output per sampled sequence, or a failure for a sequence
        whose token broke its grammar (that sequence ends with "abort")."""
        for s in scheduled:
            self._count_prompt_tokens(s)
            # Drafts count as computed once accepted (``_append``): not before their tokens are the sequence's.
            s.seq.num_computed_tokens += s.num_new_tokens - len(s.draft_token_ids)
            self.block_manager.cache_full_blocks(s.seq)
        drafted = {id(s.seq): len(s.draft_token_ids) for s in scheduled if s.draft_token_ids}
        result = StepResult()
        for s in sampled:
            self._append(s, result, drafted.get(id(s.seq), 0))
        return result

    def _count_prompt_tokens(self, s: ScheduledSeq) -> None:
        """Count the prompt tokens among ``s``'s rows (before they are counted as computed)."""
        seq = s.seq
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            self.prompt_tokens_computed += min(seq.num_prompt_tokens, seq.num_computed_tokens + s.num_new_tokens) \
                - seq.num_computed_tokens

    def _append(self, sampled: SampledTokens, result: StepResult, num_drafts: int = 0) -> None:
        """``sampled.token_ids``: the accepted drafts (of ``num_drafts``) and one token after them."""
        seq, accepted, reason = sampled.seq, 0, None
        seq.draft_token_ids = []  # used up: the proposer drafts again for the next step
        if num_drafts:
            self.spec_stats.observe(num_drafts, len(sampled.token_ids) - 1)
        for token in sampled.token_ids:
            seq.token_ids.append(token)
            accepted += 1
            if seq.grammar is not None and not seq.grammar.matcher.accept_token(token):
                # The mask allows only tokens the grammar accepts: this is a bug, not a bad request.
                error = f"token {token} is outside the output's grammar"
                logger.error("request %s: %s", seq.request_id, error)
                self.finish(seq, "abort")
                result.failures.append(RequestFailure(seq.request_id, error))
                return
            if seq.waiting_grammar is not None and token == seq.params.json_schema_after_token:
                seq.grammar, seq.waiting_grammar = seq.waiting_grammar, None
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                break
        if num_drafts and reason is None:
            # The accepted drafts' KV is verified; the last token's is computed next step. The rest
            # of the drafts' slots are rolled back: blocks holding none of the verified tokens are freed.
            seq.num_computed_tokens += accepted - 1
            self.block_manager.trim(seq)
            self.block_manager.cache_full_blocks(seq)
        result.outputs.append(StepOutput(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=sampled.token_ids[:accepted],
            finished=reason is not None,
            finish_reason=reason,
            logprobs=None if sampled.logprobs is None else sampled.logprobs[:accepted],
            prompt_logprobs=sampled.prompt_logprobs,
            kv_transfer_params=self.kv_transfer_params.pop(seq.request_id, None) if self.kv_transfer_params else None,
        ))

    def commit(self, scheduled: list[ScheduledSeq], sampled: list[Sequence]) -> list[int]:
        """Async scheduling's first half of ``update``, when a step is launched: its rows count as
        computed, and each sequence it samples gets a ``PLACEHOLDER`` token (the next step's input, taken
        from this step's sampled tensor on the device). Returns each one's placeholder index."""
        for s in scheduled:
            self._count_prompt_tokens(s)
            s.seq.num_computed_tokens += s.num_new_tokens
        slots = [len(seq.token_ids) for seq in sampled]
        for seq in sampled:
            seq.token_ids.append(PLACEHOLDER)
        return slots

    def resolve(self, scheduled: list[ScheduledSeq], computed: list[int], sampled: list[Sequence], slots: list[int],
                token_ids: list[int]) -> StepResult:
        """Async scheduling's second half, once the step's tokens are known: each sampled sequence's
        placeholder becomes its token, a stop finishes it (dropping the row a later step runs for it);
        ``computed``: each scheduled sequence's computed tokens after this step, whose full blocks enter
        the prefix cache. A sequence finished meanwhile (an abort) takes nothing."""
        bm = self.block_manager
        if bm.enable_prefix_caching:
            for s, num_computed in zip(scheduled, computed):
                # Only a step whose rows fill a block has blocks to cache (each earlier one's were cached
                # when it resolved): rows [c - n, c) cross a block boundary when c % block_size < n.
                if num_computed % bm.block_size < s.num_new_tokens and s.seq.status is SequenceStatus.RUNNING:
                    bm.cache_full_blocks(s.seq, num_computed)
        result = StepResult()
        outputs = result.outputs
        for seq, slot, token in zip(sampled, slots, token_ids):
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.token_ids[slot] = token
            reason = self._stop_reason(seq, token, slot + 1)
            if reason is not None:
                self.finish(seq, reason)
            outputs.append(StepOutput(seq.request_id, seq.index, [token], reason is not None, reason))
        return result

    def _stop_reason(self, seq: Sequence, token: int, num_tokens: int | None = None) -> FinishReason | None:
        """``num_tokens``: the sequence's length with ``token`` (its own, unless tokens are pending after it)."""
        params = seq.params
        num_tokens = seq.num_tokens if num_tokens is None else num_tokens
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.grammar is not None and token in self.eos_token_ids:
            return "stop"  # the grammar's end: its mask allows EOS only there, ignore_eos or not
        if params.max_tokens is not None and num_tokens - seq.num_prompt_tokens >= params.max_tokens:
            return "length"
        if self.max_model_len is not None and num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Retire a sequence (finished or aborted) wherever it is, freeing its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._drop_slot(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        hold, params = (False, None) if self.kv_connector is None else self.kv_connector.request_finished(seq, reason)
        if params is not None:
            self.kv_transfer_params[seq.request_id] = params
        if hold:
            self.held_blocks[seq.request_id] = self.block_manager.detach(seq)
        else:
            self.block_manager.free(seq)
        del seq.token_ids[len(seq.token_ids) - num_pending(seq):]  # the rows past its end are dropped
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


    def release_sent_blocks(self) -> None:
        """Free the held blocks the KV connector says were read by another instance (or expired)."""
        for request_id in self.kv_connector.finished_sending():
            block_ids = self.held_blocks.pop(request_id, None)
            if block_ids is not None:
                self.block_manager.release(block_ids)


def num_pending(seq: Sequence) -> int:
    """The sequence's trailing placeholders: tokens of steps still running (async scheduling)."""
    n = 0
    while n < len(seq.token_ids) - seq.num_prompt_tokens and seq.token_ids[-1 - n] == PLACEHOLDER:
        n += 1
    return n
