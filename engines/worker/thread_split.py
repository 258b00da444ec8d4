"""How many torch threads a CPU engine runs with: chosen at start by timing its decode step.

On a small machine the worker shares the cores with the HTTP process: a second thread can split a
busy decode step's attention (the C++ kernel parallelises over sequences x KV heads) and matmuls, or
lose more to the event loop it then competes with. Which wins depends on the CPU and the model, so
an engine given ``max_cpu_threads`` times one decode forward at a busy shape (batch up to 32, context
up to 512, over its own KV pool) with its current thread count and with ``max_cpu_threads``, keeps the
fastest, and says so in the log and in /health (``info.cpu_threads``). The timings are cached per
machine and shape under ``$XINSERVE_CACHE_DIR`` (``thread_timings.json``, like the kernel timings of
kernels/probes/timing.py), so a restart does not measure again.

The thread counts are timed in turns, one forward each per round, and each keeps the median of its
rounds: a burst of other work on the machine (another process starting, a compile) then slows every
count alike instead of whichever was timed during it, which the previous order (every forward of one
count, then of the next, keeping the fastest) turned into a wrong choice.
"""

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from xinserve.kernels.attention_metadata import AttentionMetadata, build_decode_gather
from xinserve.kernels.cache_dir import cache_dir
from xinserve.kernels.probes.timing import TimingCache

logger = logging.getLogger(__name__)

BATCH, CONTEXT = 32, 512  # the shape timed, capped by max_num_seqs, max_model_len and the pool
ROUNDS = 7  # rounds after a warm-up one, each timing one forward per thread count; the median is kept


@dataclass(slots=True)
class ThreadChoice:
    """The thread count an engine runs with, and why: ``measured`` now, ``cached`` from an earlier
    start on this machine, or ``fixed`` (nothing to choose from)."""

    threads: int
    source: str
    seconds: dict[int, float] = field(default_factory=dict)  # decode-step seconds per thread count

    def report(self) -> dict:
        return {"threads": self.threads, "source": self.source,
                "step_ms": {str(n): round(s * 1e3, 3) for n, s in sorted(self.seconds.items())}}


def candidates(current: int, most: int | None) -> list[int]:
    """The thread counts to time: the process's current one and ``most``."""
    return sorted({current, most or current})


def choose(counts: list[int], measure: Callable[[], float], key: str, cache: TimingCache) -> ThreadChoice:
    """Time ``measure`` (seconds of one decode step) under each thread count not cached yet, in turns
    for a warm-up round and ``ROUNDS`` more, keep each count's median, set the fastest (a tie goes to
    fewer threads) and return it."""
    seconds = {n: cache.get(f"{key}:{n}") for n in counts}
    source = "cached" if all(s is not None for s in seconds.values()) else "measured"
    timed = [n for n in counts if seconds[n] is None]
    rounds: dict[int, list[float]] = {n: [] for n in timed}
    for _ in range(1 + ROUNDS) if timed else ():
        for n in timed:
            torch.set_num_threads(n)
            rounds[n].append(measure())
    for n in timed:
        seconds[n] = statistics.median(rounds[n][1:])  # the warm-up round is dropped
        cache.put(f"{key}:{n}", seconds[n])
    best = min(counts, key=lambda n: (seconds[n], n))
    torch.set_num_threads(best)
    return ThreadChoice(best, source, seconds)


def decode_step_timer(runner, batch: int, context: int) -> Callable[[], float]:
    """Seconds of one decode forward (model + logits) of ``batch`` sequences at ``context`` tokens,
    over the runner's KV pool. Nothing has been admitted yet, so the step may read any block
    and write its new tokens' K/V into them (a block is written before anyone reads it)."""
    bs = runner.block_size
    num_blocks = runner.scratch_block  # the pool's blocks (the model's cache layout may be dense or MLA's)
    per_seq = -(-context // bs)
    tables = (np.arange(batch * per_seq, dtype=np.int64).reshape(batch, per_seq) % num_blocks).astype(np.int32)
    lens = np.full(batch, context, np.int32)
    last = tables[:, -1].astype(np.int64) * bs + (context - 1) % bs  # the new token's slot
    device = runner.device
    metadata = AttentionMetadata(
        slot_mapping=torch.from_numpy(last).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        seq_lens=torch.from_numpy(lens).to(device),
        num_decode_seqs=batch,
        prefill_query_start_loc=[0],
        prefill_seq_lens=[],
        decode_gather=build_decode_gather(tables, lens, bs, device),
    )
    input_ids = torch.zeros(batch, dtype=torch.int64, device=device)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    model = runner.model

    def measure() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            model.compute_logits(model(input_ids, positions, runner.kv_cache, metadata))
            return time.perf_counter() - start

    return measure


def choose_cpu_threads(runner, most: int | None, max_num_seqs: int, max_model_len: int,
                       cache: TimingCache | None = None) -> ThreadChoice:
    """The thread count of a CPU engine: timed (or read from the cache) when ``most`` differs from the
    current count, else the current count."""
    counts = candidates(torch.get_num_threads(), most)
    if len(counts) == 1:
        return ThreadChoice(counts[0], "fixed")
    num_blocks = runner.scratch_block
    batch = min(BATCH, max_num_seqs)
    context = max(1, min(CONTEXT, max_model_len - 1, num_blocks * runner.block_size // batch))
    # The key names the machine, the model's shapes and dtypes and the decode kernel (a rebuilt one
    # is timed again), as the kernel timings' keys do; then the shape timed and the candidates.
    shapes, dtype, _ = runner.kernel_request
    ops = {"paged_decode_attention": runner.kernels.ops.paged_decode_attention}
    key = TimingCache.key("threads", str(runner.kernels.chosen.get("decode_attention")), ops, shapes, runner.device,
                          dtype)
    key = f"{key}:{batch}x{context}"
    try:
        choice = choose(counts, decode_step_timer(runner, batch, context), key,
                        cache or TimingCache(cache_dir() / "thread_timings.json"))
    except Exception:  # a model whose decode this synthetic step does not fit must still start
        logger.exception("timing the decode step failed; keeping %d CPU thread(s)", counts[0])
        torch.set_num_threads(counts[0])
        return ThreadChoice(counts[0], "fixed")
    logger.info("CPU threads: %d (%s; decode step at batch %d x %d tokens: %s)", choice.threads, choice.source,
                batch, context, ", ".join(f"{n} thread(s) {s * 1e3:.2f} ms" for n, s in sorted(choice.seconds.items())))
    return choice


def for_engine(config, platform, runner, max_model_len: int) -> ThreadChoice | None:
    """A CPU engine's thread count (None on other devices): chosen by timing when ``max_cpu_threads``
    is set and the engine is a single rank (tensor- and pipeline-parallel ranks get theirs from
    engines/parallel/tp_runner.py)."""
    if not platform.splits_host_threads:
        return None
    single = config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1
    most = config.max_cpu_threads if single else None
    return choose_cpu_threads(runner, most, config.max_num_seqs, max_model_len)
