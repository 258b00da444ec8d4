"""The model runner of speculative method ``mtp``: the target model plus the checkpoint's MTP layer
(engines/models/mtp.py), which drafts k tokens per decoding sequence.

Each step, after the target's forward and sampling (``_sample``):
- catch-up: the MTP layer runs over every row of the step, row p reading the target's hidden state at
  p and the token at p + 1 (the prompt's next token, or the step's accepted draft / sampled token),
  which writes its KV layer for those positions; rows past the accepted tokens write slots that the
  next step overwrites (or that the rollback frees);
- the first draft: argmax of the MTP logits at the last verified position (p = N - 2, whose next
  token is the one just sampled), kept per sequence with that row's MTP hidden state.

The next step, once the scheduler has given the sequence 1 + k rows and their blocks (``_prepare``):
drafts 2..k run the MTP layer autoregressively, one decode-shaped forward per draft over the
sequences still drafting, each feeding its own hidden state to the next position (N - 1, N, ...),
whose KV slots lie in the rows the step just allocated; the catch-up of that step rewrites them
from the target's hidden states. Drafts are the MTP layer's argmax (a point mass, as
engines/speculative/verify.py assumes), copied to the host once per step.

A pure-decode step (verification included: engines/decode_rows.py) runs in a compiled or captured
decode bucket like any other; the bucket returns the target's hidden states with the logits
(``DecodeGraphs.hidden``), which the catch-up reads. The MTP layer's own forwards (the catch-up and the
k - 1 drafts) run eagerly: compiling them would take a second set of buckets (another function, over
the MTP layer's KV layer and head) and double the warm-up's compiles, for one decoder layer's worth of
work per draft.
"""

from dataclasses import dataclass

import numpy as np
import torch

from engines.models.mtp import mtp_layer_caches
from engines.runner import ModelRunner, StepBatch
from engines.scheduler import SampledTokens, ScheduledSeq
from engines.sequence import Sequence
from kernels.attention_metadata import AttentionMetadata, build_decode_gather


@dataclass(slots=True)
class DraftSeed:
    """What a sequence's next drafts start from, valid while it has ``num_tokens`` tokens."""

    num_tokens: int
    first_draft: int  # the MTP layer's token after the sequence's last token
    hidden: torch.Tensor  # [hidden]: the MTP layer's output at the last verified position


class MTPModelRunner(ModelRunner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seeds: dict[int, DraftSeed] = {}  # seq_id -> its next drafts' start
        self._hidden: torch.Tensor | None = None  # [T, hidden]: the target's output of the running step
        self.model.register_forward_hook(self._keep_hidden)

    def _keep_hidden(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        self._hidden = output

    def allocate_kv_cache(self, num_blocks: int) -> None:
        super().allocate_kv_cache(num_blocks)
        self.seeds.clear()  # a new pool (after the warm-up step) holds none of the seeds' KV

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        self.seeds.pop(seq.seq_id, None)

    def _prepare(self, scheduled: list[ScheduledSeq]) -> StepBatch:
        self._write_drafts([s for s in scheduled if s.draft_token_ids])
        return super()._prepare(scheduled)

    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        self._hidden = None  # set by the model's hook when the step runs eagerly
        logits = super().forward(batch)
        if self._hidden is None and self.decode_graphs is not None:  # it ran in a decode bucket
            self._hidden = self.decode_graphs.hidden
        return logits

    def _sample(self, batch: StepBatch, logits: torch.Tensor | None) -> list[SampledTokens]:
        sampled = super()._sample(batch, logits)
        self._catch_up(batch, sampled)
        return sampled

    def _mtp(self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor,
             metadata: AttentionMetadata) -> torch.Tensor:
        """The MTP layer over a batch laid out as ``metadata`` says. Returns its hidden states [T, hidden]."""
        model = self.model
        step_inputs = model.model.step_inputs(positions, metadata, model.cos_sin_cache, previous.dtype)
        return model.mtp(input_ids, positions, previous, mtp_layer_caches(model, self.kv_cache), step_inputs,
                         model.model.embed_tokens)

    def _draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] -> [S] int64: the MTP layer's argmax."""
        model = self.model
        head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        return model.mtp.compute_logits(hidden, head).argmax(dim=-1)

    def _catch_up(self, batch: StepBatch, sampled: list[SampledTokens]) -> None:
        """Run the MTP layer over the step's rows (module docstring); seed each sampled sequence's drafts."""
        hidden = self._hidden
        if hidden is None or not batch.seqs:
            return
        new_tokens = {id(t.seq): t.token_ids for t in sampled}
        num_drafts = {id(seq): len(d) for seq, d in zip(batch.sampled, batch.drafts)}
        next_ids = np.zeros(hidden.shape[0], dtype=np.int64)  # [T]: the token after each row's
        last_rows, seeded = [], []
        for seq, start, first_row, count in batch.spans():
            following = (seq.token_ids[start + 1 : start + 1 + count] + new_tokens.get(id(seq), []))[:count]
            next_ids[first_row : first_row + len(following)] = following
            if id(seq) in new_tokens:  # its last verified row: the accepted drafts' and the row before them
                last_rows.append(first_row + count - 1 - num_drafts.get(id(seq), 0) + len(new_tokens[id(seq)]) - 1)
                seeded.append(seq)
        mtp_hidden = self._mtp(self._to_device(next_ids), batch.positions, hidden, batch.metadata)  # [T, hidden]
        self._hidden = None
        if not seeded:
            return
        rows = mtp_hidden.index_select(0, self._to_device(np.array(last_rows, dtype=np.int64)))  # [S, hidden]
        for seq, token, row in zip(seeded, self._draft_tokens(rows).tolist(), rows):
            self.seeds[seq.seq_id] = DraftSeed(seq.num_tokens + len(new_tokens[id(seq)]), token, row)

    def _write_drafts(self, drafted: list[ScheduledSeq]) -> None:
        """Overwrite each drafted sequence's reserved draft rows with the MTP layer's drafts."""
        chains: list[tuple[ScheduledSeq, DraftSeed]] = []
        for s in drafted:
            seed = self.seeds.get(s.seq.seq_id)
            if seed is None or seed.num_tokens != s.seq.num_tokens:  # no seed: drafts that verification rejects
                s.draft_token_ids[:] = [s.seq.token_ids[-1]] * len(s.draft_token_ids)
            else:
                chains.append((s, seed))
        if not chains:
            return
        lengths = np.array([len(s.draft_token_ids) for s, _ in chains])  # [S] k of each
        tokens = torch.tensor([seed.first_draft for _, seed in chains], device=self.device)  # [S]
        hidden = torch.stack([seed.hidden for _, seed in chains])  # [S, hidden]
        steps = [(np.arange(len(chains)), tokens)]
        for j in range(1, int(lengths.max())):
            active = steps[-1][0]
            keep = np.flatnonzero(lengths[active] > j)  # the sequences that still draft, among the active
            index = self._to_device(keep)
            hidden = hidden.index_select(0, index)
            seqs = [chains[i][0].seq for i in active[keep]]
            positions = np.array([seq.num_tokens - 2 + j for seq in seqs], dtype=np.int64)
            hidden = self._mtp(tokens.index_select(0, index), self._to_device(positions), hidden,
                               self._decode_metadata(seqs, positions))
            tokens = self._draft_tokens(hidden)
            steps.append((active[keep], tokens))
        drafts = torch.cat([t for _, t in steps]).tolist()  # the drafts' one device -> host copy
        first = 0
        for j, (active, _) in enumerate(steps):  # step j made draft j of its active sequences
            for i, token in zip(active, drafts[first : first + len(active)]):
                chains[i][0].draft_token_ids[j] = token
            first += len(active)

    def _decode_metadata(self, seqs: list[Sequence], positions: np.ndarray) -> AttentionMetadata:
        """One decode row per sequence at ``positions`` ([S]), in slots its block table already holds."""
        bs = self.block_size
        slots = np.array([seq.block_table[p // bs] for seq, p in zip(seqs, positions)], dtype=np.int64) * bs
        width = max(len(seq.block_table) for seq in seqs)
        block_tables = np.array([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs],
                                dtype=np.int32)
        seq_lens = (positions + 1).astype(np.int32)
        return AttentionMetadata(
            slot_mapping=self._to_device(slots + positions % bs), block_tables=self._to_device(block_tables),
            seq_lens=self._to_device(seq_lens), num_decode_seqs=len(seqs), prefill_query_start_loc=[0],
            prefill_seq_lens=[], decode_gather=build_decode_gather(block_tables, seq_lens, bs, self.device),
            prefill_prompt_lens=[],
        )
