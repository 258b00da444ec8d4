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

A pure-decode step (verification included: engines/worker/decode_rows.py) runs in a compiled or captured
decode bucket like any other; the bucket returns the target's hidden states with the logits
(``DecodeGraphs.hidden``), which the catch-up reads. The MTP layer's own forwards (the catch-up and the
k - 1 drafts) run eagerly: compiling them would take a second set of buckets (another function, over
the MTP layer's KV layer and head) and double the warm-up's compiles, for one decoder layer's worth of
work per draft.

Under tensor / expert parallel every rank runs the same MTP forwards (each holds collectives) from what
rank 0 shares before each one (``share``: engines/parallel/rank_messages.py): the chain's sequences and
block tables, then the catch-up's next tokens and seeded rows. The draft logits are gathered on every
rank (engines/models/tensor_parallel.py), so every rank drafts, and verifies, the same tokens.
"""

from dataclasses import dataclass

import numpy as np
import torch

from xinserve.engines.core.scheduler import SampledTokens, ScheduledSeq
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.models.mtp import mtp_layer_caches
from xinserve.engines.parallel.rank_messages import CatchUp, Chain
from xinserve.engines.worker.runner import ModelRunner, StepBatch
from xinserve.kernels.attention_metadata import AttentionMetadata, build_decode_gather


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
        self.released: list[int] = []  # seq ids let go of since the last catch-up (the other ranks' seeds)
        # the target's latest forward: (positions [T], its attention metadata, its output [T, hidden])
        self._step: tuple[torch.Tensor, AttentionMetadata, torch.Tensor] | None = None
        self.model.register_forward_hook(self._keep_hidden)

    def _keep_hidden(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        self._step = (args[1], args[3], output)  # forward(input_ids, positions, kv_cache, metadata)

    def share(self, work: Chain | CatchUp) -> None:
        """Hand MTP work to the group's other ranks (engines/parallel/tp_runner.py); one device has none."""

    def follow(self, work: Chain | CatchUp) -> None:
        """A rank > 0: run the MTP work rank 0 shared, as rank 0 runs it."""
        if isinstance(work, Chain):
            self._run_chain(work)
        else:
            self._run_catch_up(work)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        super().allocate_kv_cache(num_blocks)
        self.seeds.clear()  # a new pool (after the warm-up step) holds none of the seeds' KV
        self.released.clear()

    def release(self, seq: Sequence) -> None:
        super().release(seq)
        if self.seeds.pop(seq.seq_id, None) is not None:
            self.released.append(seq.seq_id)

    def _prepare(self, scheduled: list[ScheduledSeq], with_gather: bool = True) -> StepBatch:
        self._write_drafts([s for s in scheduled if s.draft_token_ids])
        return super()._prepare(scheduled, with_gather)

    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        self._step = None  # set by the model's hook when the step runs eagerly
        logits = super().forward(batch)
        if self._step is None and self.decode_graphs is not None and self.decode_graphs.hidden is not None:
            self.inputs.plan_gather(batch)  # it ran in a decode bucket, without the plan: the MTP layer runs eagerly
            self._step = (batch.positions, batch.metadata, self.decode_graphs.hidden)
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
        if self._step is None or not batch.seqs:
            return
        new_tokens = {id(t.seq): t.token_ids for t in sampled}
        num_drafts = {id(seq): len(d) for seq, d in zip(batch.sampled, batch.drafts)}
        next_ids = np.zeros(len(batch.positions), dtype=np.int64)  # [T]: the token after each row's
        last_rows, seeded = [], []
        for seq, start, first_row, count in batch.spans():
            following = (seq.token_ids[start + 1 : start + 1 + count] + new_tokens.get(id(seq), []))[:count]
            next_ids[first_row : first_row + len(following)] = following
            if id(seq) in new_tokens:  # its last verified row: the accepted drafts' and the row before them
                last_rows.append(first_row + count - 1 - num_drafts.get(id(seq), 0) + len(new_tokens[id(seq)]) - 1)
                seeded.append(seq)
        work = CatchUp(next_ids, np.array(last_rows, dtype=np.int64),
                       np.array([seq.seq_id for seq in seeded], dtype=np.int64), np.array(self.released, dtype=np.int64))
        self.share(work)
        self.released.clear()
        self._run_catch_up(work)
        for seq in seeded:
            self.seeds[seq.seq_id].num_tokens = seq.num_tokens + len(new_tokens[id(seq)])

    def _run_catch_up(self, work: CatchUp) -> None:
        """The MTP layer over the latest target forward's rows; a seed for each of ``work.seq_ids``."""
        for seq_id in work.released.tolist():
            self.seeds.pop(seq_id, None)
        if self._step is None:
            return
        positions, metadata, hidden = self._step
        self._step = None
        mtp_hidden = self._mtp(self._to_device(work.next_ids), positions, hidden, metadata)  # [T, hidden]
        if not len(work.seq_ids):
            return
        rows = mtp_hidden.index_select(0, self._to_device(work.last_rows))  # [S, hidden]
        for seq_id, token, row in zip(work.seq_ids.tolist(), self._draft_tokens(rows).tolist(), rows):
            self.seeds[seq_id] = DraftSeed(0, token, row)

    def _write_drafts(self, drafted: list[ScheduledSeq]) -> None:
        """Overwrite each drafted sequence's reserved draft rows with the MTP layer's drafts."""
        chained: list[ScheduledSeq] = []
        for s in drafted:
            seed = self.seeds.get(s.seq.seq_id)
            if seed is None or seed.num_tokens != s.seq.num_tokens:  # no seed: drafts that verification rejects
                s.draft_token_ids[:] = [s.seq.token_ids[-1]] * len(s.draft_token_ids)
            else:
                chained.append(s)
        if not chained:
            return
        seqs = [s.seq for s in chained]
        width = max(len(seq.block_table) for seq in seqs)
        work = Chain(np.array([seq.seq_id for seq in seqs], dtype=np.int64),
                     np.array([len(s.draft_token_ids) for s in chained], dtype=np.int64),
                     np.array([seq.num_tokens for seq in seqs], dtype=np.int64),
                     np.array([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs], dtype=np.int32))
        self.share(work)
        for s, drafts in zip(chained, self._run_chain(work)):
            s.draft_token_ids[:] = drafts

    def _run_chain(self, work: Chain) -> list[list[int]]:
        """Drafts 1..k of each chained sequence: its seed's, then one MTP decode step per further draft over
        the sequences still drafting, each fed its own hidden state (module docstring)."""
        seeds = [self.seeds[seq_id] for seq_id in work.seq_ids.tolist()]
        tokens = torch.tensor([seed.first_draft for seed in seeds], device=self.device)  # [C]
        hidden = torch.stack([seed.hidden for seed in seeds])  # [C, hidden]
        steps = [(np.arange(len(seeds)), tokens)]
        for j in range(1, int(work.lengths.max())):
            active = steps[-1][0]
            keep = np.flatnonzero(work.lengths[active] > j)  # the sequences that still draft, among the active
            index = self._to_device(keep)
            hidden = hidden.index_select(0, index)
            chained = active[keep]
            positions = work.num_tokens[chained] - 2 + j
            hidden = self._mtp(tokens.index_select(0, index), self._to_device(positions), hidden,
                               self._decode_metadata(work.block_tables[chained], positions))
            tokens = self._draft_tokens(hidden)
            steps.append((chained, tokens))
        flat = torch.cat([t for _, t in steps]).tolist()  # the drafts' one device -> host copy
        drafts: list[list[int]] = [[] for _ in seeds]
        first = 0
        for active, _ in steps:  # step j made draft j of its active sequences
            for i, token in zip(active, flat[first : first + len(active)]):
                drafts[i].append(token)
            first += len(active)
        return drafts

    def _decode_metadata(self, block_tables: np.ndarray, positions: np.ndarray) -> AttentionMetadata:
        """One decode row per sequence at ``positions`` ([S]), in slots its block table ([S, W]) holds."""
        bs = self.block_size
        width = int((positions // bs).max()) + 1  # the blocks the rows reach
        block_tables = np.ascontiguousarray(block_tables[:, :width])
        slots = block_tables[np.arange(len(positions)), positions // bs].astype(np.int64) * bs
        seq_lens = (positions + 1).astype(np.int32)
        return AttentionMetadata(
            slot_mapping=self._to_device(slots + positions % bs), block_tables=self._to_device(block_tables),
            seq_lens=self._to_device(seq_lens), num_decode_seqs=len(positions), prefill_query_start_loc=[0],
            prefill_seq_lens=[], decode_gather=build_decode_gather(block_tables, seq_lens, bs, self.device),
            prefill_prompt_lens=[],
        )
