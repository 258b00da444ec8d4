"""Rank 0's messages to its other ranks (engines/parallel/rank_messages.py): every kind comes back from
the wire as it was packed, each kind is its own number, and the wire is a flat int64 tensor."""

import numpy as np
import pytest
import torch

from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.scheduler import ScheduledSeq
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.parallel.rank_messages import (
    Allocate,
    CatchUp,
    Chain,
    Kind,
    LoraDrop,
    LoraLoad,
    Profile,
    RankMessage,
    Step,
    Stop,
    pack,
    unpack,
)
from xinserve.engines.worker.step_inputs import StepInputs

BS = 4
CPU = torch.device("cpu")


def sequence(seq_id: int, length: int, computed: int) -> Sequence:
    seq = Sequence(seq_id, str(seq_id), [3 + (seq_id * 7 + j) % 50 for j in range(length)], SamplingParams(temperature=0))
    seq.block_table, seq.num_computed_tokens = [10 + seq_id * 8 + b for b in range(-(-length // BS))], computed
    return seq


def step_batch(with_prefill: bool):
    """Two decodes, and (``with_prefill``) a prompt's first chunk (no token sampled, so logits_indices
    are sent) and a whole prompt."""
    scheduled = [ScheduledSeq(sequence(0, 6, 5), 1), ScheduledSeq(sequence(1, 9, 8), 1)]
    if with_prefill:
        scheduled += [ScheduledSeq(sequence(2, 11, 0), 5), ScheduledSeq(sequence(3, 7, 0), 7)]
    return StepInputs(BS, CPU).prepare(scheduled)


def chain() -> Chain:
    return Chain(np.array([4, 9]), np.array([3, 1]), np.array([17, 5]), np.array([[2, 5, 8], [6, 0, 0]], dtype=np.int32))


def catch_up() -> CatchUp:
    return CatchUp(np.array([11, 12, 13, 14]), np.array([1, 3]), np.array([4, 9]), np.array([2]))


def round_trip(message: RankMessage) -> RankMessage:
    wire = pack(message)
    assert wire.dtype == torch.int64 and wire.dim() == 1
    return unpack(wire.clone(), CPU, BS)  # a copy: nothing shares the sender's memory


def test_the_kinds_are_unique_and_each_message_names_its_own():
    assert len({int(kind) for kind in Kind}) == len(Kind)
    messages = [Step(step_batch(False), None), Allocate(3), Profile(0.5), Stop(), chain(), catch_up(), LoraLoad(1, "/a"),
                LoraDrop(1)]
    assert sorted(int(pack(m)[0]) for m in messages) == sorted(int(kind) for kind in Kind)


@pytest.mark.parametrize("message", [Allocate(1234), Profile(0.9), Profile(0.0), Stop()])
def test_a_command_comes_back_as_it_was(message):
    assert round_trip(message) == message


def test_mtp_work_comes_back_as_it_was():
    for sent in (chain(), catch_up(), CatchUp(np.array([5]), np.array([], dtype=np.int64),
                                              np.array([], dtype=np.int64), np.array([], dtype=np.int64))):
        got = round_trip(sent)
        assert type(got) is type(sent)
        for name in sent.__slots__:
            assert getattr(got, name).tolist() == getattr(sent, name).tolist(), name
    assert round_trip(chain()).block_tables.dtype == np.int32


@pytest.mark.parametrize("with_prefill", [False, True])
@pytest.mark.parametrize("prompt_rows", [None, [], [(2, 4), (7, 6)]])
def test_a_step_comes_back_as_the_batch_rank_0_built(with_prefill, prompt_rows):
    sent = step_batch(with_prefill)
    got = round_trip(Step(sent, prompt_rows))
    assert isinstance(got, Step) and got.prompt_rows == prompt_rows
    batch, m, want = got.batch, got.batch.metadata, sent.metadata
    assert torch.equal(batch.input_ids, sent.input_ids) and torch.equal(batch.positions, sent.positions)
    assert (batch.logits_indices is None) == (sent.logits_indices is None) == (not with_prefill)
    if with_prefill:
        assert torch.equal(batch.logits_indices, sent.logits_indices)
    assert len(batch.sampled) == (len(sent.logits_indices) if with_prefill else len(sent.sampled))
    for name in ("slot_mapping", "block_tables", "seq_lens"):
        assert torch.equal(getattr(m, name), getattr(want, name)), name
    assert m.block_tables.dtype == want.block_tables.dtype == torch.int32
    assert (m.num_decode_seqs, m.prefill_query_start_loc, m.prefill_seq_lens) == (
        want.num_decode_seqs, list(want.prefill_query_start_loc), list(want.prefill_seq_lens))
    assert m.prefill_prompt_lens == list(want.prefill_prompt_lens or want.prefill_seq_lens)
    assert m.decode_gather.context_len == want.decode_gather.context_len
    assert torch.equal(m.decode_gather.block_ids, want.decode_gather.block_ids)


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown rank message kind 99"):
        unpack(torch.tensor([99, 0], dtype=torch.int64), CPU, BS)
