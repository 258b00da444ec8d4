"""The engine loop: schedule -> run the model and sample -> the scheduler's update. Drives one device."""

import itertools
import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait

from transformers import AutoTokenizer, GenerationConfig

from xinserve.engines.config import EngineConfig
from xinserve.engines.core.async_scheduling import AsyncScheduling, overlappable
from xinserve.engines.core.kv_cache import BlockManager
from xinserve.engines.core.outputs import (
    EngineStats,
    FinishReason,
    RequestFailure,
    StepResult,
    spec_decode_stats,
)
from xinserve.engines.core.request_checks import check_prompt, check_token_fields
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.scheduler import SampledTokens, ScheduledSeq, Scheduler, num_pending
from xinserve.engines.core.sequence import Sequence, SequenceStatus
from xinserve.engines.kv.event_publisher import make_publisher
from xinserve.engines.kv.events import EventBatch
from xinserve.engines.kv.host_tier import make_host_tier
from xinserve.engines.kv.mooncake_connector import make_remote_connector
from xinserve.engines.lora.registry import LoraRegistry
from xinserve.engines.parallel.tp_runner import make_runner
from xinserve.engines.platforms import get_platform
from xinserve.engines.pooling.engine_step import make_pooler, pooling_step, with_runner
from xinserve.engines.speculative.config import parse_speculative_config
from xinserve.engines.speculative.proposer import make_proposer
from xinserve.engines.structured.compiler import GrammarCompiler, PendingGrammar
from xinserve.engines.worker import thread_split
from xinserve.engines.worker.runner import always_plain_greedy
from xinserve.engines.worker.warmup import Warmup

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config = with_runner(config)
        self.platform = get_platform(config.device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        block_size = config.block_size or self.platform.default_block_size
        self.eos_token_ids = self._eos_token_ids()
        self.runner = make_runner(config, self.platform, block_size, sorted(self.eos_token_ids))
        self.pooler = make_pooler(self)  # a pooling engine's (engines/pooling/); None when it generates
        max_model_len = self._max_model_len(self.runner.hf_config.max_position_embeddings)
        num_blocks = config.num_kv_blocks or self._profile_num_blocks(block_size, max_model_len)
        # A sequence can never outgrow the whole pool: cap the context so it always fits alone.
        self.max_model_len = min(max_model_len, num_blocks * block_size)
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.init_decode_graphs(self.max_model_len)
        # Torch threads timed before the warm-up thread competes for the cores (engines/worker/thread_split.py).
        self.thread_choice = thread_split.for_engine(config, self.platform, self.runner, self.max_model_len)
        # Deferred C++ kernel builds, then the CPU decode buckets: after ready unless asked otherwise.
        self.warmup = Warmup.for_engine(config, self.runner, self.max_model_len)
        # A KV connector (engines/kv/connector.py): the host tier below the pool (kv_offloading_size) or
        # another instance's pool (kv_transfer_config); and KV events for routers (kv_events_config).
        self.kv_tier = make_host_tier(config.kv_offloading_size, self.runner, block_size,
                                      self.platform.pins_host_memory)
        self.kv_connector = self.kv_tier or make_remote_connector(
            config.kv_transfer_config, self.runner, block_size, config.data_parallel_rank)
        self.kv_events = make_publisher(config.kv_events_config, config.data_parallel_rank)
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching,
                                          record_events=self.kv_events is not None, external=self.kv_tier,
                                          match_next_token=config.uses_mtp)
        if self.kv_connector is not None:
            self.kv_connector.bind_block_manager(self.block_manager)
            self.kv_connector.register_kv_caches(self.runner.kv_cache)
        # LoRA adapters (engines/lora/): their host copies and device slots
        self.loras = LoraRegistry.of(config, self.runner)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.eos_token_ids, self.max_model_len, self.kv_connector,
                                   self.loras and self.loras.slots)
        self.speculative = None if config.speculative_config is None else parse_speculative_config(
            config.speculative_config)
        self.proposer = None if self.speculative is None else make_proposer(self.speculative)
        self.requests: dict[str, list[Sequence]] = {}
        # Ids in ``requests`` that async scheduling must know of, kept as requests come and go so that it asks
        # once per request, not every step: those whose steps cannot run ahead of their tokens
        # (async_scheduling.overlappable), and those that may sample past a plain argmax (runner.always_plain_greedy).
        self.synchronous_requests: set[str] = set()
        self.sampling_requests: set[str] = set()
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        # request_id -> (its grammar being compiled, its sequences): held back from the scheduler
        self._compiling: dict[str, tuple[PendingGrammar, list[Sequence]]] = {}
        self._seq_ids = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        logger.info(
            "engine ready on %s: %d KV blocks of %d tokens, max_model_len %d, KV cache %s (%d bytes per token)",
            config.device, num_blocks, block_size, self.max_model_len, str(self.runner.kv_dtype).removeprefix("torch."),
            self.runner.bytes_per_block() // block_size,
        )

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        # generation_config.json sits with the weights, whichever directory the tokenizer is in.
        try:
            eos = GenerationConfig.from_pretrained(self.config.model).eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        return ids

    def _max_model_len(self, max_position_embeddings: int) -> int:
        """The configured context, refused when longer than the model's rotary table reaches."""
        requested = self.config.max_model_len
        if requested is None:
            return max_position_embeddings
        if requested > max_position_embeddings:
            raise ValueError(f"max_model_len {requested} is more than this model's max_position_embeddings "
                             f"{max_position_embeddings}")
        return requested

    def _profile_num_blocks(self, block_size: int, max_model_len: int) -> int:
        fraction = self.config.kv_cache_memory_fraction or self.platform.default_kv_cache_memory_fraction
        num_blocks = self.runner.profile_num_blocks(
            self.config.max_num_batched_tokens, self.config.max_num_seqs, max_model_len, fraction
        )
        # More than every slot at full length (twice, to keep a prefix cache) would sit unused.
        useful = 2 * self.config.max_num_seqs * -(-max_model_len // block_size)
        num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise RuntimeError("no memory left for the KV cache after the warm-up forward")
        return num_blocks

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine, the KV-event publisher and the warm-up."""
        self.warmup.stop()
        self.runner.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.kv_connector is not None:
            self.kv_connector.close()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in the pool and in the host tier (vLLM's reset_prefix_cache)."""
        self.block_manager.reset_prefix_cache()
        if self.kv_connector is not None:
            self.kv_connector.clear()
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """The step's KV events as one batch (none published for a step without any)."""
        events = self.block_manager.take_events()
        if events and self.kv_events is not None:
            self.kv_events.publish(EventBatch(time.time(), events))

    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at ``path`` as ``name`` (between steps); ValueError when it cannot be served."""
        LoraRegistry.enabled(self.loras).add(name, path)

    def remove_lora(self, name: str) -> None:
        """New requests can no longer name it; those running or waiting finish with it. KeyError if not loaded."""
        LoraRegistry.enabled(self.loras).remove(name)

    def lora_names(self) -> list[str]:
        return [] if self.loras is None else self.loras.names()

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises ValueError when it could never run (the server answers 400)."""
        if self.pooler is not None:
            raise ValueError(f"this model is served for pooling ({self.config.convert}), not generation")
        if request_id in self.requests or request_id in self.scheduler.held_blocks:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_prompt(prompt_token_ids, self.max_model_len, self.vocab_size)
        check_token_fields(params, self.vocab_size)
        if params.kv_transfer_params is not None:
            self._check_kv_transfer(params)
        now = time.monotonic()
        first = Sequence(next(self._seq_ids), request_id, prompt_token_ids, params, now)
        seqs = [first] + [
            Sequence(next(self._seq_ids), request_id, prompt_token_ids, params, now, index=i, parent=first)
            for i in range(1, params.n)
        ]
        if params.lora_name is not None:  # ValueError when not loaded
            LoraRegistry.enabled(self.loras).start(params.lora_name, seqs)
        if params.json_schema is None:
            for seq in seqs:
                self.scheduler.add(seq)
        else:
            self._compiling[request_id] = (self.grammars.compile(params.json_schema), seqs)
        self.requests[request_id] = seqs
        if not overlappable(params):
            self.synchronous_requests.add(request_id)
        if not always_plain_greedy(params):
            self.sampling_requests.add(request_id)
        self.prompt_tokens_total += len(prompt_token_ids)

    def _check_kv_transfer(self, params: SamplingParams) -> None:
        """A request that hands its KV to another instance, or takes it from one (vLLM's kv_transfer_params)."""
        if self.kv_tier is not None or self.kv_connector is None:
            raise ValueError("kv_transfer_params needs an engine started with kv_transfer_config "
                             "(--kv-transfer-config)")
        # A prefill hands one sequence's blocks over; a decode's extra choices share the loaded prompt.
        if params.n != 1 and params.kv_transfer_params.get("do_remote_decode"):
            raise ValueError(f"kv_transfer_params.do_remote_decode needs n 1, got {params.n}")
        self.kv_connector.check_request(params.kv_transfer_params)

    def release_sent_kv(self) -> None:
        """Free the blocks another instance finished reading (or whose hold expired); the worker calls it
        when idle too, since no step runs then."""
        if self.kv_connector is not None and self.scheduler.held_blocks:
            self.scheduler.release_sent_blocks()

    def abort_request(self, request_id: str, index: int | None = None, emitted: int | None = None) -> None:
        """Stop a request (or one choice of it) now and free its KV blocks. Unknown ids are ignored.
        ``emitted`` (with ``index``): the choice's output tokens its client got (a stop string ended it);
        the ones generated past them (a speculative step's later drafts, steps run before this abort
        arrived) leave ``generation_tokens_total``, which counts only what is emitted."""
        for seq in self.requests.get(request_id, []):
            if not seq.is_finished and (index is None or seq.index == index):
                if emitted is not None and index is not None:
                    # Tokens of a step still running (async scheduling) are not counted yet.
                    self.generation_tokens_total -= max(0, seq.num_output_tokens - num_pending(seq) - emitted)
                self._finish(seq, "abort")

    def async_steps(self) -> "AsyncScheduling | None":
        """A stepper that schedules step N+1 while step N runs (engines/core/async_scheduling.py), or None where this
        engine does not: speculative decoding, a host KV tier, several ranks, an accelerator without its setting."""
        schedules_ahead = self.platform.schedules_ahead or self.config.async_scheduling_on_accelerators
        if (self.proposer is not None or self.kv_connector is not None or not schedules_ahead
                or self.config.tensor_parallel_size * self.config.pipeline_parallel_size > 1):
            return None
        return AsyncScheduling(self)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def step(self) -> StepResult:
        if self.pooler is not None:
            return pooling_step(self)
        failures = self._admit_compiled() if self._compiling else []
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        self.release_sent_kv()
        scheduled = self.scheduler.schedule()
        if self.kv_connector is not None:
            # Before the forward: the connector's transfers (the host tier's evictions out of the pool,
            # then tier hits or another instance's blocks into it).
            scheduled = self._load_kv(scheduled, failures)
        if not scheduled:
            return StepResult([], failures)
        sampled, scheduled, failed = self._execute(scheduled)
        result = self.scheduler.update(scheduled, sampled)
        for failure in result.failures:  # one choice broke its grammar: the request fails whole
            self.abort_request(failure.request_id)
        self._publish_kv_events()
        self._forget_finished([s.seq for s in sampled])
        self.generation_tokens_total += sum(len(out.new_token_ids) for out in result.outputs)
        result.failures[:0] = failures + failed
        return result

    def _execute(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[list[SampledTokens], list[ScheduledSeq], list[RequestFailure]]:
        """Run the step; when it fails, run its sequences one by one (``_execute_one_by_one``)."""
        try:
            return self.runner.execute(scheduled), scheduled, []
        except Exception:
            logger.exception("step of %d sequences failed; running them one by one", len(scheduled))
            return self._execute_one_by_one(scheduled)

    def _load_kv(self, scheduled: list[ScheduledSeq], failures: list[RequestFailure]) -> list[ScheduledSeq]:
        """Run the step's KV transfers; a sequence whose blocks were not filled leaves the step and, as
        ``kv_load_failure_policy`` says, recomputes from its first unfilled block in later steps
        (``recompute``) or fails (``fail``, a 500 added to ``failures``). Returns the step's sequences."""
        connector = self.kv_connector
        connector.start_load_kv(connector.build_connector_meta())
        unfilled = connector.get_block_ids_with_load_errors()
        if not unfilled:
            return scheduled
        kept = []
        for s in scheduled:
            seq = s.seq
            first_bad = next((i for i, block_id in enumerate(seq.block_table) if block_id in unfilled), None)
            if first_bad is None:
                kept.append(s)
            elif connector.load_failure_policy == "fail":
                logger.warning("request %s: its KV could not be loaded; failing it", seq.request_id)
                self.abort_request(seq.request_id)
                failures.append(RequestFailure(
                    seq.request_id, "the KV cache could not be loaded from the prefill instance "
                                    "(kv_load_failure_policy fail)"))
            else:
                logger.warning("request %s: its KV could not be loaded; recomputing it", seq.request_id)
                seq.num_computed_tokens = min(seq.num_computed_tokens, first_bad * self.block_manager.block_size)
        return kept

    def _admit_compiled(self) -> list[RequestFailure]:
        """Hand requests whose grammar is compiled to the scheduler, each sequence with its own matcher.
        Returns a failure per request whose grammar failed to compile."""
        if not self.scheduler.has_unfinished():
            # Nothing else to run: wait a little for a compile instead of spinning the worker loop.
            wait([p.future for p, _ in self._compiling.values()], timeout=0.01, return_when=FIRST_COMPLETED)
        failed: list[RequestFailure] = []
        now = time.monotonic()
        timeout_s = self.grammars.limits.compile_timeout_s
        for request_id, (pending, seqs) in list(self._compiling.items()):
            if pending.overdue(now, timeout_s):
                # Fail the request now; its thread finishes on its own and nothing waits for it.
                pending = self.grammars.expire(pending, f"the JSON schema took more than {timeout_s:g}s to compile")
            elif not pending.future.done():
                continue
            if pending.future.exception() is not None:
                error = f"the JSON schema could not be compiled: {pending.future.exception()}"
                for seq in list(seqs):  # the last one's _finish drops the request from _compiling
                    self._finish(seq, "abort")
                failed.append(RequestFailure(request_id, error, bad_request=True))
                continue
            del self._compiling[request_id]
            self.grammars.account(pending)
            for seq in seqs:
                grammar = self.grammars.new_grammar(pending.future.result())
                if seq.params.json_schema_after_token is None:
                    seq.grammar = grammar
                else:  # unconstrained until the token that starts the answer
                    seq.waiting_grammar = grammar
                self.scheduler.add(seq)
        return failed

    def _execute_one_by_one(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[list[SampledTokens], list[ScheduledSeq], list[RequestFailure]]:
        """After a failed step, run each sequence alone, so that a request the failure can be
        traced to fails by itself (every choice of it ends with "abort") and the others go on.
        Returns the sampled tokens and the sequences that ran, and one failure per failed request."""
        sampled: list[SampledTokens] = []
        ran: list[ScheduledSeq] = []
        failed_requests: dict[str, str] = {}
        for s in scheduled:
            if s.seq.request_id in failed_requests:
                continue
            try:
                sampled.extend(self.runner.execute([s]))
                ran.append(s)
            except Exception as exc:
                logger.exception("request %s fails the step on its own; failing it", s.seq.request_id)
                failed_requests[s.seq.request_id] = f"{type(exc).__name__}: {exc}"
        for request_id in failed_requests:
            self.abort_request(request_id)
        ran = [s for s in ran if s.seq.request_id not in failed_requests]
        sampled = [t for t in sampled if t.seq.request_id not in failed_requests]
        failed = [RequestFailure(request_id, error) for request_id, error in failed_requests.items()]
        return sampled, ran, failed

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.request_id in self._compiling:  # never handed to the scheduler: nothing to free
            self._compiling[seq.request_id][1].remove(seq)
            if not self._compiling[seq.request_id][1]:
                del self._compiling[seq.request_id]
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        else:
            self.scheduler.finish(seq, reason)
        self._forget_finished([seq])

    def _forget_finished(self, seqs: list[Sequence]) -> None:
        """Drop the runner's state of each finished sequence, and a request once all its choices are done."""
        for seq in seqs:
            if seq.status is not SequenceStatus.FINISHED:
                continue
            self.runner.release(seq)
            if self.loras is not None:
                self.loras.finished(seq.seq_id)
            choices = self.requests.get(seq.request_id, [])
            if all(s.is_finished for s in choices):
                self.requests.pop(seq.request_id, None)
                self.synchronous_requests.discard(seq.request_id)
                self.sampling_requests.discard(seq.request_id)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=bm.prefix_cache_queries,
            prefix_cache_hits_total=bm.prefix_cache_hits,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            spec_decode=None if self.speculative is None else spec_decode_stats(
                self.speculative.method, self.scheduler.spec_stats),
            external_prefix_cache_queries_total=bm.external_queries,
            external_prefix_cache_hits_total=bm.external_hits,
            prompt_tokens_computed_total=self.scheduler.prompt_tokens_computed,
            **({} if self.loras is None else self.loras.stats(self.scheduler.running, self.scheduler.waiting)),
            **({} if self.kv_connector is None else self.kv_connector.transfer_counters()),
        )
