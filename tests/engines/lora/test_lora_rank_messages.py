"""LoRA's part of rank 0's messages (engines/parallel/rank_messages.py): a step's row slots and (slot,
adapter) pairs, and the adapter loads and drops every rank mirrors, come back from the wire as packed."""

import numpy as np
import torch

from tests.engines.parallel.test_rank_messages import BS, round_trip, sequence
from xinserve.engines.core.scheduler import ScheduledSeq
from xinserve.engines.lora.registry import AdapterRef
from xinserve.engines.parallel.rank_messages import LoraDrop, LoraLoad, Step
from xinserve.engines.worker.step_inputs import StepInputs


def test_a_step_carries_each_rows_slot_and_the_pairs_its_slots_must_hold():
    seqs = [sequence(0, 6, 5), sequence(1, 9, 8), sequence(2, 11, 0)]
    seqs[0].lora, seqs[0].lora_slot = AdapterRef(7, "a", "/a", 1), 1
    seqs[2].lora, seqs[2].lora_slot = AdapterRef(9, "b", "/b", 2), 0
    scheduled = [ScheduledSeq(seqs[0], 1), ScheduledSeq(seqs[1], 1), ScheduledSeq(seqs[2], 5)]
    batch = StepInputs(BS, torch.device("cpu"), with_lora=True).prepare(scheduled)
    assert batch.lora_slots.tolist() == [1, -1, 0, 0, 0, 0, 0] and batch.lora_pairs == [(0, 9), (1, 7)]
    back = round_trip(Step(batch, None)).batch
    assert np.array_equal(back.lora_slots, batch.lora_slots) and back.lora_pairs == batch.lora_pairs
    assert torch.equal(back.input_ids, batch.input_ids)
    plain = round_trip(Step(StepInputs(BS, torch.device("cpu")).prepare(scheduled[:2]), None)).batch
    assert plain.lora_slots is None and plain.lora_pairs == []


def test_adapter_loads_and_drops_round_trip_with_their_paths():
    assert round_trip(LoraLoad(3, "/models/adapters/sql-ünïcode")) == LoraLoad(3, "/models/adapters/sql-ünïcode")
    assert round_trip(LoraDrop(3)) == LoraDrop(3)
