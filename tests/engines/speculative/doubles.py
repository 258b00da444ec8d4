"""Test-double proposers: drafts that are right (or wrong) on purpose, to drive verification."""

import random

from xinserve.engines.core.sequence import Sequence


class OracleProposer:
    """Drafts the expected continuation of each prompt (``expected``: prompt tuple -> output tokens).
    With ``wrong_rate`` > 0 each draft token is replaced by a wrong one with that probability
    (seeded), so steps accept every prefix length from none to all."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], k: int, wrong_rate: float = 0.0,
                 seed: int = 0) -> None:
        self.expected, self.k, self.wrong_rate = expected, k, wrong_rate
        self.rng = random.Random(seed)

    def propose(self, running: list[Sequence]) -> None:
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            done = seq.num_output_tokens
            draft = list(self.expected[tuple(seq.prompt_token_ids)][done : done + self.k])
            for i, token in enumerate(draft):
                if self.rng.random() < self.wrong_rate:
                    draft[i] = token - 1 if token > 0 else 1  # inside the vocabulary
            seq.draft_token_ids = draft


class TableProposer:
    """Drafts ``table[output so far]`` (a tuple of output tokens -> draft tokens), else nothing."""

    def __init__(self, table: dict[tuple[int, ...], list[int]]) -> None:
        self.table = table

    def propose(self, running: list[Sequence]) -> None:
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens == 1:
                seq.draft_token_ids = list(self.table.get(tuple(seq.output_token_ids), []))
