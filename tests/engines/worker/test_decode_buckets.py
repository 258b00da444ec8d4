"""Filling a decode bucket's static buffers (engines/worker/decode_buckets.py), the step before each replay:
padded rows do no real work (a context of one token, a table of the scratch block only, their key/value
to the scratch block), and on an accelerator the fill waits for nothing and allocates nothing: every
operator it issues writes into the buffers in place or views them, none reads a device value back
(checked on the meta device, whose tensors hold no values: any read back would raise)."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xinserve.engines.worker.decode_buckets import DecodeBuffers
from xinserve.kernels.attention_metadata import AttentionMetadata

SIZES, MAX_MODEL_LEN, BS, SCRATCH = [1, 2, 4, 8], 64, 4, 99
HOST_READS = {"_local_scalar_dense", "_to_copy", "item", "equal", "is_nonzero"}


def step(device: torch.device, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
    """A pure-decode step of len(lens) rows: (input ids, positions, metadata, host context lengths)."""
    n, width = len(lens), -(-max(lens) // BS)
    tables = torch.arange(n * width, dtype=torch.int32).view(n, width) + 1
    for row, length in enumerate(lens):
        tables[row, -(-length // BS) :] = 0  # padded with 0 past each row's blocks, as the runner's are
    positions = torch.tensor([length - 1 for length in lens])
    slots = torch.tensor([int(tables[i, p // BS]) * BS + p % BS for i, p in enumerate(positions.tolist())])
    metadata = AttentionMetadata(slot_mapping=slots.to(device), block_tables=tables.to(device),
                                 seq_lens=torch.tensor(lens, dtype=torch.int32).to(device), num_decode_seqs=n,
                                 prefill_query_start_loc=[0], prefill_seq_lens=[])
    ids = torch.arange(10, 10 + n)
    return ids.to(device), positions.to(device), metadata, np.array(lens, np.int32)


def test_padded_rows_read_and_write_only_the_scratch_block() -> None:
    buffers = DecodeBuffers(SIZES, MAX_MODEL_LEN, BS, SCRATCH, torch.device("cpu"))
    buffers.fill(8, *step(torch.device("cpu"), [40] * 8))  # a full bucket first: stale rows everywhere
    lens = [9, 30, 17]
    assert buffers.fill(4, *step(torch.device("cpu"), lens))
    ids, positions, metadata = buffers.inputs(4)
    assert ids.tolist() == [10, 11, 12, 0] and positions.tolist() == [8, 29, 16, 0]
    assert metadata.seq_lens.tolist() == [*lens, 1]  # the padding row attends to one token
    assert metadata.decode_gather.host_seq_lens.tolist() == [*lens, 1]
    assert metadata.slot_mapping[3] == SCRATCH * BS  # its key/value land in the scratch block
    assert (metadata.block_tables[3] == SCRATCH).all()  # its one block read is the scratch block
    widths = [-(-n // BS) for n in lens]
    for row, width in enumerate(widths):  # real rows: their table, then zeros (never a stale row's blocks)
        assert (metadata.block_tables[row, :width] > 0).all() and (metadata.block_tables[row, width:] == 0).all()
    mask = metadata.decode_gather.mask[:, 0, 0]  # the reference's: True where a position holds context
    assert mask.sum(dim=1).tolist() == [*lens, 1]


def test_a_step_wider_than_the_bucket_table_runs_eagerly() -> None:
    buffers = DecodeBuffers(SIZES, MAX_MODEL_LEN, BS, SCRATCH, torch.device("cpu"))
    assert not buffers.fill(2, *step(torch.device("cpu"), [MAX_MODEL_LEN + 1, 3]))


class OperatorLog(TorchDispatchMode):
    """Every aten operator run while open, with whether it wrote in place / to ``out`` or made a view."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        in_place = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        view = any(r.alias_info is not None for r in schema.returns) and not in_place
        self.ops.append((func.__name__ if hasattr(func, "__name__") else str(func), in_place or view))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("lens", [[5], [9, 30, 17], [33] * 8], ids=["1 row", "3 rows padded to 4", "a full bucket"])
def test_an_accelerator_fill_allocates_nothing_and_reads_nothing_back(lens: list[int]) -> None:
    meta = torch.device("meta")  # not the host: the fill takes its torch path, as on a GPU
    buffers = DecodeBuffers(SIZES, MAX_MODEL_LEN, BS, SCRATCH, meta)
    ids, positions, metadata, host_lens = step(meta, lens)
    size = next(s for s in SIZES if s >= len(lens))
    with OperatorLog() as log:
        assert buffers.fill(size, ids, positions, metadata, host_lens)
    assert log.ops, "the fill issued no operator"
    names = [name for name, _ in log.ops]
    assert not HOST_READS & {name.split(".")[0] for name in names}, names
    allocating = [name for name, writes_or_views in log.ops if not writes_or_views]
    assert allocating == [], f"operators that allocate a new tensor: {allocating}"
    assert buffers.host_seq_lens[: len(lens)].tolist() == lens  # the host lengths Ascend's kernels read
    assert buffers.host_seq_lens[len(lens) : size].tolist() == [1] * (size - len(lens))
