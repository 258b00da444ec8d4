"""Acceptance counters of speculative decoding, with vLLM's meaning: per verified sequence-step one
draft, its tokens, and the accepted ones (in total and by position). No torch."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0  # sequence-steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts whose token i was accepted

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verification: ``num_accepted`` of its ``num_draft_tokens`` drafts, a prefix."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

