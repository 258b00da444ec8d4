"""A step's inputs (engines/worker/step_inputs.py): the block tables kept from step to step give the same arrays
as tables built afresh whatever happens between steps (a block boundary crossed, a row taken by another
request, a preempted sequence back with other blocks, fewer or more rows, a wider table), and a batch
prepared without its gather plan gets the one ``build_decode_gather`` makes."""

import random

import numpy as np
import torch

from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.scheduler import ScheduledSeq
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.worker.step_inputs import BlockTables, StepInputs
from xinserve.kernels.attention_metadata import build_decode_gather

BS = 4
CPU = torch.device("cpu")


def decoding(seq_id: int, length: int, blocks: list[int]) -> Sequence:
    seq = Sequence(seq_id, str(seq_id), [3 + (seq_id * 7 + j) % 50 for j in range(length)], SamplingParams(temperature=0))
    seq.block_table, seq.num_computed_tokens = list(blocks), length - 1
    return seq


def fresh(seqs: list[Sequence]) -> np.ndarray:
    width = max(len(s.block_table) for s in seqs)
    return np.array([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=np.int32)


def test_kept_block_tables_equal_fresh_ones_through_every_change():
    tables = BlockTables()
    a, b, c = decoding(0, 4, [1]), decoding(1, 6, [2, 3]), decoding(2, 3, [4])
    steps = []
    seqs = [a, b, c]
    steps.append(list(seqs))
    a.block_table.append(7)  # a crosses into its second block
    steps.append(list(seqs))
    seqs = [a, decoding(3, 2, [9]), c]  # b finished; a new request takes its row (its table is shorter)
    steps.append(list(seqs))
    c.block_table[:] = [6]  # c preempted and back with another block: a table as long as before
    steps.append(list(seqs))
    seqs = [a, c]  # fewer rows
    steps.append(list(seqs))
    d = decoding(4, 30, list(range(10, 18)))  # a wider table than any before, and one more row
    seqs = [a, c, d]
    steps.append(list(seqs))
    steps.append([d, c, a])  # the same sequences in another order
    for step in steps:
        got = tables(step)
        assert got.tolist() == fresh(step).tolist()
        got[:] = -1  # the caller owns what it got: the kept copy is not touched
    assert tables([a, c, d]).tolist() == fresh([a, c, d]).tolist()


def test_prepare_keeps_its_state_yet_equals_a_fresh_prepare_over_random_steps():
    rng = random.Random(5)
    kept = StepInputs(BS, CPU)
    free = list(range(1, 400))
    running = [decoding(i, rng.randint(2, 9), []) for i in range(6)]
    for seq in running:
        seq.block_table = [free.pop() for _ in range(-(-seq.num_tokens // BS))]
    next_id = 6
    for _ in range(60):
        scheduled = [ScheduledSeq(s, 1) for s in running]
        if rng.random() < 0.3:  # a prompt prefilled beside the decodes
            prompt = decoding(next_id, rng.randint(3, 12), [])
            prompt.num_computed_tokens = 0
            prompt.block_table = [free.pop() for _ in range(-(-prompt.num_tokens // BS))]
            scheduled.append(ScheduledSeq(prompt, prompt.num_tokens))
            next_id += 1
        got, want = kept.prepare(scheduled), StepInputs(BS, CPU).prepare(scheduled)
        for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens"):
            assert getattr(got.host, name).tolist() == getattr(want.host, name).tolist(), name
        assert got.sampled == want.sampled and got.seqs == want.seqs
        for seq in running:  # each decode computed its token and sampled the next
            seq.num_computed_tokens += 1
            seq.token_ids.append(rng.randrange(3, 50))
            if seq.num_computed_tokens + 1 > len(seq.block_table) * BS:
                seq.block_table.append(free.pop())
        if rng.random() < 0.2:  # one leaves; another (a preempted one, back with new blocks) joins
            running.pop(rng.randrange(len(running)))
            back = decoding(next_id, rng.randint(2, 20), [])
            back.block_table = [free.pop() for _ in range(-(-back.num_tokens // BS))]
            running.insert(rng.randrange(len(running) + 1), back)
            next_id += 1


def test_a_batch_prepared_without_its_gather_plan_gets_the_same_plan_later():
    seqs = [decoding(0, 5, [3, 1]), decoding(1, 9, [4, 6, 2]), decoding(2, 2, [8])]
    scheduled = [ScheduledSeq(s, 1) for s in seqs]
    inputs = StepInputs(BS, CPU)
    batch = inputs.prepare(scheduled, with_gather=False)
    assert batch.metadata.decode_gather is None
    inputs.plan_gather(batch)
    got = batch.metadata.decode_gather
    want = build_decode_gather(fresh(seqs), np.array([5, 9, 2], dtype=np.int32), BS, CPU)
    assert got.context_len == want.context_len == 9
    assert torch.equal(got.block_ids, want.block_ids) and torch.equal(got.mask, want.mask)
    assert torch.equal(got.host_seq_lens, want.host_seq_lens)
