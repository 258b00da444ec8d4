"""A pooling engine's requests and steps: each request is one prompt prefilled (in chunks, batched by
the same scheduler as generation) and pooled; it samples nothing and keeps no KV after it (its blocks
are freed at once, its full blocks staying in the prefix cache)."""

import logging
import time
from dataclasses import replace
from typing import Any

import torch

from xinserve.engines.config import EngineConfig
from xinserve.engines.core.outputs import RequestFailure, StepOutput, StepResult
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.scheduler import ScheduledSeq
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.pooling.model_spec import read_pooler_spec, resolve_runner
from xinserve.engines.pooling.params import PoolingParams
from xinserve.engines.pooling.pooler import Pooler
from xinserve.engines.worker.runner import ModelRunner

# ``engine``: the ``LLMEngine`` (engines/core/engine.py) these functions serve, which imports this module.
logger = logging.getLogger(__name__)

# The scheduler's bookkeeping reads a request's SamplingParams; a pooling request samples nothing.
_PREFILL_ONLY = SamplingParams(temperature=0, max_tokens=1)


def with_runner(config: EngineConfig) -> EngineConfig:
    """``config`` with its runner and convert decided (engines/pooling/model_spec.py). A pooling engine
    never decodes: no compiled decode buckets, no step run ahead of its tokens; one rank for now."""
    runner, convert = resolve_runner(config.model, config.runner or "auto", config.convert)
    if runner == "generate":
        return replace(config, runner=runner)
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1 or config.speculative_config is not None:
        raise ValueError("runner pooling is built for one rank without speculative decoding")
    # Mean / CLS pooling read every prompt row: a prefix-cache hit would leave some uncomputed.
    spec = read_pooler_spec(config.model, convert, config.classifier_from_token)
    return replace(config, runner=runner, convert=convert, compile="off", async_scheduling=False,
                   enable_prefix_caching=config.enable_prefix_caching and not spec.reads_every_row)


def make_pooler(engine: Any) -> Pooler | None:
    """The pooler of an engine whose config says runner pooling; None for a generating one."""
    config = engine.config
    if config.runner != "pooling":
        return None
    spec = read_pooler_spec(config.model, config.convert, config.classifier_from_token)
    token_ids = None
    if spec.score_tokens is not None:
        vocab = engine.tokenizer.get_vocab()
        missing = [t for t in spec.score_tokens if t not in vocab]
        if missing:
            raise ValueError(f"classifier_from_token: {', '.join(map(repr, missing))} not in the tokenizer's vocabulary")
        token_ids = (vocab[spec.score_tokens[0]], vocab[spec.score_tokens[1]])
    logger.info("pooling runner: %s, %s pooling%s", spec.task, spec.method,
                f", score tokens {spec.score_tokens}" if spec.score_tokens else "")
    return Pooler(spec, engine.runner.model, token_ids)


def add_pooling_request(engine: Any, request_id: str, prompt_token_ids: list[int],
                        params: PoolingParams) -> None:
    """Queue a pooling request. Raises ValueError when it could never run (the server answers 400)."""
    pooler = engine.pooler
    if pooler is None:
        raise ValueError("this model is served for generation (runner generate), not pooling")
    pooler.spec.check(params)
    if request_id in engine.requests:
        raise ValueError(f"request id {request_id!r} is already in use")
    if not prompt_token_ids:
        raise ValueError("the input is empty")
    if len(prompt_token_ids) > engine.max_model_len:
        raise ValueError(f"the input has {len(prompt_token_ids)} tokens, but this model's maximum context length "
                         f"is {engine.max_model_len} tokens")
    vocab_size = engine.runner.hf_config.vocab_size
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise ValueError(f"input token ids must be in [0, {vocab_size})")
    seq = Sequence(next(engine._seq_ids), request_id, prompt_token_ids, _PREFILL_ONLY, time.monotonic())
    pooler.add(seq, params)
    engine.scheduler.add(seq)
    engine.requests[request_id] = [seq]
    engine.prompt_tokens_total += len(prompt_token_ids)


def pooling_step(engine: Any) -> StepResult:
    """Schedule -> forward and pool -> the scheduler's bookkeeping; each prompt computed to its end is
    finished with its pooled output. A failing step runs its sequences one by one (the one that fails
    alone is failed)."""
    engine.pooler.drop_finished()  # aborted since the last step
    scheduled = engine.scheduler.schedule()
    if not scheduled:
        return StepResult()
    failures: list[RequestFailure] = []
    done: list[tuple[Sequence, list[float]]] = []
    try:
        done = _forward(engine.runner, engine.pooler, scheduled)
    except Exception:
        logger.exception("pooling step of %d sequences failed; running them one by one", len(scheduled))
        scheduled = _one_by_one(engine, scheduled, done, failures)
    engine.scheduler.update(scheduled, [])  # computed tokens; full blocks into the prefix cache
    result = StepResult(failures=failures)
    for seq, output in done:
        engine.scheduler.finish(seq, "stop")  # its blocks freed now: a pooling request keeps no KV
        engine._forget_finished([seq])
        engine.pooler.release(seq)
        result.outputs.append(StepOutput(seq.request_id, 0, [], True, "stop", pooled=output))
    return result


def _one_by_one(engine: Any, scheduled: list[ScheduledSeq], done: list,
                failures: list[RequestFailure]) -> list[ScheduledSeq]:
    """Run each sequence alone; a failing one's request is aborted and reported. Returns those that ran."""
    ran = []
    for s in scheduled:
        try:
            done.extend(_forward(engine.runner, engine.pooler, [s]))
            ran.append(s)
        except Exception as exc:
            logger.exception("pooling request %s fails on its own; failing it", s.seq.request_id)
            engine.abort_request(s.seq.request_id)
            failures.append(RequestFailure(s.seq.request_id, f"{type(exc).__name__}: {exc}"))
    return ran


@torch.inference_mode()
def _forward(runner: ModelRunner, pooler: Pooler, scheduled: list[ScheduledSeq]) -> list[tuple[Sequence, list[float]]]:
    """One forward over the step's rows; each sequence's rows go to the pooler. Returns the outputs of
    the sequences whose prompts end in this step."""
    with runner.step_lock:
        batch = runner.inputs.prepare(scheduled, True)
        runner.inputs.plan_gather(batch)
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_cache, batch.metadata)  # [T, hidden]
        for seq, start, first_row, count in batch.spans():
            pooler.take(seq, start, hidden[first_row : first_row + count])
        return list(zip(batch.sampled, pooler.finish(batch.sampled, runner.dtype)))
