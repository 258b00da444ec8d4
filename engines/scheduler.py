"""Continuous batching over one token budget per step. No torch.

There is no prefill phase and no decode phase: each running sequence's ``num_computed_tokens``
catches up with its ``num_tokens`` within the step's token budget, so a long prompt is prefilled in
chunks while other sequences keep decoding in the same step. Running sequences go first (oldest
first); waiting ones are admitted FCFS while budget, sequence slots and blocks last. When blocks
run out the newest running sequence is preempted (its KV is dropped and recomputed later).
"""

from collections import deque
from dataclasses import dataclass

from engines.kv_cache import BlockManager
from engines.sequence import Sequence, SequenceStatus, needs_prompt_logits


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
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
            computed = [] if needs_prompt_logits(seq) else self.block_manager.computed_blocks(seq)
            cached_tokens = len(computed) * self.block_manager.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - cached_tokens, budget)
            if not self.block_manager.allocate_slots(seq, num_new, computed):
                break
            self.block_manager.record_prefix_lookup(seq, computed)
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

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) wherever it is, freeing its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
