"""The proposer an engine drafts with, by ``speculative_config.method``. No torch.

``ngram`` drafts real tokens before the step is scheduled. ``mtp`` cannot: its drafts come from the
checkpoint's MTP layer, which runs on the device once the step's blocks are allocated
(engines/speculative/mtp_runner.py). Before scheduling it only reserves k rows per eligible sequence,
with placeholder tokens the runner overwrites before the forward.
"""

from xinserve.engines.core.sequence import Sequence
from xinserve.engines.speculative.config import SpeculativeConfig
from xinserve.engines.speculative.eligibility import may_draft
from xinserve.engines.speculative.ngram import NgramProposer

PLACEHOLDER = 0  # a reserved draft row's token until the MTP runner writes the real draft


class MTPProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, running: list[Sequence]) -> None:
        """Reserve ``num_speculative_tokens`` draft rows for each decoding sequence that may be drafted
        for; none while more than ``disable_by_batch_size`` sequences run."""
        if len(running) > self.config.disable_by_batch_size:
            return
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens == 1 and may_draft(seq):
                seq.draft_token_ids = [PLACEHOLDER] * self.config.num_speculative_tokens


def make_proposer(config: SpeculativeConfig) -> NgramProposer | MTPProposer:
    return MTPProposer(config) if config.method == "mtp" else NgramProposer(config)
