"""Async scheduling (vLLM's ``--async-scheduling``): step N+1 is scheduled and prepared while step N runs.

Each running sequence is assumed to get one more token from step N: the scheduler's ``commit`` counts
N's rows as computed and gives each sampled sequence a placeholder token, so N+1 is scheduled before N's
tokens are known. N+1's input ids for those rows are taken from N's sampled-token tensor on the device
(no host round trip). Once N's tokens are known, ``resolve`` puts them in place and corrects what the
assumption got wrong: a sequence that finished at N (EOS, a stop token, max_tokens) is finished, and the
row N+1 runs for it is dropped (its blocks are freed at once; a later step that reuses them runs after
N+1, whose write to them is then overwritten). A sequence that ends for certain at N (max_tokens, the
context) gets no N+1 row at all. A stop string or an abort found while N+1 runs finishes it the same way.

Steps run in order on one executor thread, with the GIL released in the torch kernels, so the caller's
Python work (resolving N, sending its outputs, taking new requests, scheduling and preparing N+1) runs
while the step's forward runs. What async cannot do runs synchronously (``LLMEngine.step``), one step
at a time, whenever a request needs it: log-probs or prompt log-probs, penalties (they read the output
tokens), structured output (the grammar advances with each token); ``LLMEngine.async_steps`` refuses
engines with speculative decoding, a host KV tier or several ranks, and accelerators unless
``async_scheduling_on_accelerators`` (the device script measures it: tests/gpu/bench_cuda.py). On an
accelerator the step thread makes the engine's card current; its kernels, the next step's input copies and
a decode bucket's buffer fill are ordered on the card's stream.
A failed step is rolled back (its placeholders and computed tokens, and the step launched after it)
and run again synchronously, where a failing request is found and failed alone.
"""

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from xinserve.engines.core.outputs import StepResult
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.scheduler import PLACEHOLDER, ScheduledSeq, num_pending
from xinserve.engines.core.sequence import Sequence, SequenceStatus
from xinserve.engines.platforms import is_host
from xinserve.engines.worker.runner import _plain_greedy
from xinserve.engines.worker.sampler import SamplingRow

logger = logging.getLogger(__name__)

Rows = torch.Tensor | slice  # [P] int64 row indices, or the slice they make


def overlappable(params: SamplingParams) -> bool:
    """Whether a request's steps can run ahead of its tokens: nothing reads the token just sampled."""
    return (params.logprobs is None and params.prompt_logprobs is None and not params.has_penalties
            and params.json_schema is None)


@dataclass(slots=True)
class Launched:
    """One step handed to the executor."""

    scheduled: list[ScheduledSeq]
    computed: list[int]  # each scheduled sequence's computed tokens after the step
    sampled: list[Sequence]  # in the sampled tensor's order
    slots: list[int]  # each sampled sequence's placeholder index
    future: Future | None = None  # the executor's, set as soon as the step is handed to it
    tokens: torch.Tensor | None = None  # [len(sampled)] int64 on the device, set when the step has run


def _enter_step_thread(threads: int, device: torch.device) -> None:
    torch.set_num_threads(threads)
    if not is_host(device):
        getattr(torch, device.type).set_device(device)


class AsyncScheduling:
    """Drives an ``LLMEngine`` one step ahead; ``step()`` returns the outputs of the step before."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.runner = engine.runner
        # A new thread starts with OpenMP's default thread count, not the engine's (engines/worker/thread_split.py),
        # and with the accelerator's first card current, not the engine's.
        self._executor = ThreadPoolExecutor(1, "xinserve-step", _enter_step_thread,
                                            (torch.get_num_threads(), self.runner.device))
        self.inflight: Launched | None = None
        self.overlapped = 0  # steps scheduled while the one before was running
        self.synchronous = 0  # steps run by LLMEngine.step

    def has_unfinished(self) -> bool:
        return self.inflight is not None or self.engine.has_unfinished_requests()

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def step(self) -> StepResult:
        if self.inflight is None:
            if not self._can_overlap():
                self.synchronous += 1
                return self.engine.step()
            self.inflight = self._launch(None)
            if self.inflight is None:
                return StepResult()
        current = self.inflight
        try:
            self.inflight = self._launch(current) if self._can_overlap() else None
        except Exception:
            self.inflight = None
            self._wait(current)
            raise
        if self.inflight is not None:
            self.overlapped += 1
        return self._resolve(current)

    def _can_overlap(self) -> bool:
        engine = self.engine
        return not engine._compiling and not engine.synchronous_requests

    def _launch(self, previous: Launched | None) -> Launched | None:
        """Schedule and prepare a step (``previous`` still running) and hand it to the executor."""
        scheduler = self.engine.scheduler
        scheduled = scheduler.schedule()
        if not scheduled:
            return None
        # Host arrays and tensors viewing them, no autograd op: no inference mode needed here. The gather
        # plan only an eager step reads is left to the step thread (ModelRunner.forward).
        batch = self.runner._prepare(scheduled, with_gather=False)
        rows, sources = self._pending_rows(batch, previous)
        # Sampling settings read on this thread: a sequence finished meanwhile must not create state.
        plain = not self.engine.sampling_requests or all(_plain_greedy(s) for s in batch.sampled)
        sampling = None if plain else [
            self.runner._sampling_row(s) for s in batch.sampled]
        slots = scheduler.commit(scheduled, batch.sampled)
        launched = Launched(scheduled, [s.seq.num_computed_tokens for s in scheduled], batch.sampled, slots)
        launched.future = self._executor.submit(self._run, batch, sampling, rows, sources, previous, launched)
        return launched

    def _pending_rows(self, batch: Any, previous: Launched | None) -> tuple[Rows | None, Rows | None]:
        """The rows whose input is a placeholder ([P] int64) and where ``previous`` sampled each ([P] int64)."""
        ids = batch.host.input_ids
        rows = (ids == PLACEHOLDER).nonzero()[0]
        if not len(rows):
            return None, None
        n = len(rows)
        if (previous is not None and rows[-1] == n - 1 and n <= batch.metadata.num_decode_seqs
                and batch.seqs[:n] == previous.sampled[:n]):
            # The usual step: its first n rows decode the first n sequences the step before sampled, in that
            # order (list equality of sequences is identity). Slices: no index tensors to build.
            return slice(0, n), slice(0, n)
        order = {id(seq): i for i, seq in enumerate(previous.sampled)} if previous is not None else {}
        # Only a decode row reads a placeholder, and only the step before's (older ones are resolved).
        sources = [order.get(id(batch.seqs[row])) if row < batch.metadata.num_decode_seqs else None for row in rows]
        if None in sources:
            raise RuntimeError("a step's input is a token no earlier step samples")
        device = self.runner.device
        return torch.from_numpy(rows).to(device), torch.tensor(sources, dtype=torch.int64, device=device)

    def _run(self, batch: Any, sampling: list[SamplingRow] | None, rows: Rows | None,
             sources: Rows | None, previous: Launched | None, launched: Launched) -> list[int]:
        """On the executor thread: the pending inputs, the forward, the sample; the tokens to the host."""
        runner = self.runner
        with torch.inference_mode(), runner.step_lock:
            if rows is not None:
                if previous is None or previous.tokens is None:
                    raise RuntimeError("the step before this one failed")
                batch.input_ids[rows] = previous.tokens[sources]  # on the device, no host round trip
            logits = runner.forward(batch)
            if logits is None:
                launched.tokens = torch.empty(0, dtype=torch.int64, device=runner.device)
                return []
            tokens = logits.argmax(dim=-1) if sampling is None else runner.sampler(logits, sampling).token_ids
            launched.tokens = tokens
            return tokens.tolist()  # the step's one device -> host copy

    def _resolve(self, launched: Launched) -> StepResult:
        engine = self.engine
        try:
            token_ids = launched.future.result()
        except Exception:
            logger.exception("an async step of %d sequences failed; running it again synchronously",
                             len(launched.scheduled))
            return self._recover(launched)
        result = engine.scheduler.resolve(launched.scheduled, launched.computed, launched.sampled, launched.slots,
                                          token_ids)
        engine._publish_kv_events()
        engine._forget_finished(launched.sampled)
        engine.generation_tokens_total += len(result.outputs)
        return result

    def _recover(self, failed: Launched) -> StepResult:
        """Undo the failed step and the one launched after it, then run the step synchronously."""
        ahead, self.inflight = self.inflight, None
        for launched in (ahead, failed):
            if launched is None:
                continue
            self._wait(launched)
            for s, computed in zip(launched.scheduled, launched.computed):
                seq = s.seq
                if seq.is_finished:
                    continue
                del seq.token_ids[len(seq.token_ids) - num_pending(seq):]
                if seq.status is SequenceStatus.RUNNING:
                    seq.num_computed_tokens = computed - s.num_new_tokens
        self.synchronous += 1
        return self.engine.step()

    @staticmethod
    def _wait(launched: Launched) -> None:
        """Until ``launched`` has run; its outcome is dropped (the caller undoes or reports the step)."""
        launched.future.exception()
