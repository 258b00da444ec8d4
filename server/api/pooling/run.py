"""One pooling request's path, shared by every pooling endpoint: check the model's key scope and the
inputs -> route and tokenise off the loop -> refuse a model that does not serve the task -> one engine
request per input on the chosen worker (batched there by its scheduler) -> their outputs, or the
first one's error as a 4xx/5xx after aborting the rest -> the request's log line."""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import Request

from xinserve.engines.pooling.params import PoolingParams
from xinserve.server.api.common import ClientDisconnected, log_fields, new_request_id, run_until_disconnect
from xinserve.server.api.pooling.inputs import Input, check_inputs, fit_context, tokenize
from xinserve.server.api.prompt import route_encoded
from xinserve.server.errors import APIError
from xinserve.server.http.auth import may_use
from xinserve.server.pool.worker_client import WorkerClient
from xinserve.server.worker.messages import RequestError

# The task a pooling endpoint needs -> the API's name in the error a model without it answers.
API_NAMES = {"embed": "Embeddings", "classify": "Classification"}


@dataclass(slots=True)
class PoolingRun:
    """A finished pooling request: its outputs in input order, and what its log line reads."""

    request_id: str
    model: str
    worker: WorkerClient
    outputs: list[list[float]]
    prompt_tokens: int
    completion_tokens: int = 0
    labels: list[str] | None = None  # a classifier's label names
    lora_name: None = None  # pooling runs on the base model only (its log line names no adapter)


async def run_pooling(
    request: Request, model: str, inputs: list[Input], params: PoolingParams, *, prefix: str,
    truncate_prompt_tokens: int | None = None, param: str = "input",
    check_model: Callable[[dict[str, Any]], None] | None = None,
    encode: Callable[[Any], list[list[int]]] | None = None,
) -> PoolingRun:
    """Pool every input on one worker of ``model``. ``check_model(pooling_info)``: the endpoint's
    further checks of the model (beyond its task); ``encode(tokenizer)``: the engine inputs when they are
    not ``inputs`` tokenised one by one (a cross-encoder's pairs). ``ClientDisconnected`` when the client left."""
    state = request.app.state
    allowed = partial(may_use, request)
    target = state.router.resolve(model, allowed)  # 404 for an unknown model or one the key may not use
    if target.lora_name is not None:
        raise APIError(400, f"'{model}' is a LoRA adapter: pooling requests run on the base model only.",
                       param="model", code="model_not_supported")
    check_inputs(inputs, state.config.limits, param)
    encode = encode or (lambda tokenizer: tokenize(tokenizer, inputs, param))
    # Admitted as one request: a worker's capacity (max_num_seqs + max_waiting_requests) bounds requests,
    # while up to limits.max_pooling_inputs inputs of one request queue in its scheduler.
    pool, worker, ids = await route_encoded(state.router, target, 1, lambda p: encode(p.tokenizer),
                                            may_use=allowed)
    info = worker.info.get("pooling")
    if info is None or info["task"] != params.task:
        raise APIError(400, f"The model '{model}' does not support the {API_NAMES[params.task]} API (it is served "
                       f"for {'generation' if info is None else info['task']}).", param="model",
                       code="model_not_supported")
    if check_model is not None:
        check_model(info)
    ids = fit_context(ids, int(worker.info["max_model_len"]), truncate_prompt_tokens, param)
    run = PoolingRun(new_request_id(prefix), pool.name, worker, [], sum(map(len, ids)), labels=info.get("labels"))
    names = [f"{run.request_id}-{i}" for i in range(len(ids))]
    try:
        streams = [worker.add(name, item, params) for name, item in zip(names, ids)]
        timeout_s = state.config.server.request_timeout_s
        items = await run_until_disconnect(request, asyncio.wait_for(
            asyncio.gather(*(s.queue.get() for s in streams)), timeout_s))
    except TimeoutError:
        _abort(worker, names)
        log_fields(request, run, "error 504")
        raise APIError(504, f"The request timed out after {timeout_s:g}s.", code="timeout") from None
    except ClientDisconnected:
        _abort(worker, names)
        log_fields(request, run, "disconnected")
        raise
    except BaseException:
        _abort(worker, names)
        log_fields(request, run, "error 500")
        raise
    error = next((item for item in items if isinstance(item, RequestError)), None)
    if error is not None:
        _abort(worker, names)
        log_fields(request, run, f"error {error.status}")
        raise APIError(error.status, error.message, param=param if error.client_fault else None)
    run.outputs = [item.pooled for item in items]
    log_fields(request, run, "ok")
    return run


def _abort(worker: WorkerClient, names: list[str]) -> None:
    for name in names:
        worker.abort(name)  # finished or unknown ids are ignored


def served_task(request: Request, model: str) -> str | None:
    """The pooling task of ``model``'s ready workers (None: none ready, or it generates); the route's
    own checks (scope, readiness) still follow in ``run_pooling``."""
    pool = request.app.state.router.pools.get(model)
    for worker in pool.ready_workers() if pool is not None else []:
        info = worker.info.get("pooling")
        return None if info is None else info["task"]
    return None


def usage(run: PoolingRun) -> dict[str, int]:
    return {"prompt_tokens": run.prompt_tokens, "total_tokens": run.prompt_tokens}
