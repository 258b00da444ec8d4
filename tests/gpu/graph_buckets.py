"""The captured decode buckets on a GPU (engines/worker/graphs.py), for check_cuda.py and bench_cuda.py:

- ``replay_check``: every captured bucket, filled with a step that pads (n - 1 rows into bucket n) and
  replayed three times, allocates nothing (``torch.cuda.memory_stats``: allocations and bytes unchanged)
  and never syncs the host (``torch.cuda.set_sync_debug_mode("error")`` around fill and replay);
- ``bucket_rows``: decode-only ms/step at each bucket's own batch and at a batch that pads into it (3 -> 4),
  with graphs and eager, the two engines alternating per batch and each warmed at that batch first.
"""

import time

import numpy as np
import torch

from xinserve.kernels.attention_metadata import AttentionMetadata

ALLOCATION_STATS = ("allocation.all.allocated", "allocated_bytes.all.current", "segment.all.allocated")


def replay_check(graphs) -> list[dict]:
    """One row per captured bucket: {bucket, rows, allocations, bytes, host_sync (error text or None), ok}."""
    buffers, rows = graphs.buffers, []
    scratch_slot = buffers.scratch_block * buffers.block_size
    for size, replay in sorted(graphs.steps.items()):
        n = max(1, size - 1)
        device = buffers.input_ids.device
        ids, positions = torch.ones(n, dtype=torch.int64, device=device), torch.zeros(n, dtype=torch.int64, device=device)
        metadata = AttentionMetadata(
            slot_mapping=torch.full((n,), scratch_slot, dtype=torch.int64, device=device),
            block_tables=torch.full((n, 1), buffers.scratch_block, dtype=torch.int32, device=device),
            seq_lens=torch.ones(n, dtype=torch.int32, device=device), num_decode_seqs=n,
            prefill_query_start_loc=[0], prefill_seq_lens=[])
        host_lens = np.ones(n, np.int32)
        buffers.fill(size, ids, positions, metadata, host_lens)
        replay()  # a first replay outside the measurement
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        error = None
        try:
            torch.cuda.set_sync_debug_mode("error")
            for _ in range(3):
                buffers.fill(size, ids, positions, metadata, host_lens)
                replay()
        except RuntimeError as exc:
            error = str(exc).splitlines()[0][:200]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        delta = {stat: after.get(stat, 0) - before.get(stat, 0) for stat in ALLOCATION_STATS}
        rows.append({"bucket": size, "rows": n, "allocation_deltas": delta, "host_sync": error,
                     "ok": error is None and not any(delta.values())})
    return rows


def decode_ms(engine, batch: int, prompt_len: int, steps: int, warm: int = 3, stepper=None) -> float:
    """Mean ms of ``steps`` decode-only steps at ``batch`` sequences (prefill and ``warm`` decode steps
    first, then timed; the requests aborted after). ``stepper``: an ``engine.async_steps()`` to step
    through (step N+1 scheduled while N runs) instead of ``engine.step``."""
    from xinserve.engines import SamplingParams

    step = engine.step if stepper is None else stepper.step
    params = SamplingParams(temperature=0, max_tokens=warm + steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", [7 + (i * 31 + j * 7) % 900 for j in range(prompt_len)], params)
    try:
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                              for s in engine.scheduler.running):
            step()
        for _ in range(warm):
            step()
        engine.runner.platform.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        engine.runner.platform.synchronize()
        return (time.perf_counter() - start) * 1e3 / steps
    finally:
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
        while stepper is not None and stepper.has_unfinished():
            stepper.step()


def bucket_batches(sizes: list[int]) -> list[tuple[int, int]]:
    """(bucket, batch) pairs: each bucket at its own size and, where one fits, a batch that pads into it
    (the largest below it but above the bucket before: 3 -> 4, 6 -> 8, ...)."""
    pairs, previous = [], 0
    for size in sizes:
        if size - 1 > previous:
            pairs.append((size, size - 1 if size <= 4 else (previous + size) // 2 + 1))
        pairs.append((size, size))
        previous = size
    return pairs


def bucket_rows(graphs_engine, eager_engine, sizes: list[int], prompt_len: int, steps: int) -> list[dict]:
    """Per (bucket, batch): graph and eager decode ms/step, the order alternating per batch."""
    rows = []
    for i, (bucket, batch) in enumerate(bucket_batches(sizes)):
        engines = [("graphs", graphs_engine), ("eager", eager_engine)]
        times = {name: decode_ms(engine, batch, prompt_len, steps) for name, engine in engines[:: 1 if i % 2 else -1]}
        rows.append({"bucket": bucket, "batch": batch, "graphs_ms": times["graphs"], "eager_ms": times["eager"],
                     "graphs_over_eager": times["graphs"] / times["eager"]})
    return rows
