"""The worker endpoints the SGLang model gateway (``sglang-router``) probes, in SGLang's shapes.

When the gateway adds a worker URL it waits for ``/health``, then reads ``/server_info`` (falling back
to ``/get_server_info``) and ``/model_info`` (``/get_model_info``): ``served_model_name`` becomes the
model id it lists on its own ``/v1/models`` and routes by, and ``model_path`` is where it loads the
tokenizer it registers for that model. Its ``power_of_two`` policy polls ``/get_load`` (one entry
per data-parallel rank; it sums ``num_tokens``). A server with several models describes the first
one the key may use: the gateway expects one model per worker URL.
"""

import json
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from xinserve.server.disagg.bootstrap import bootstrap_port
from xinserve.server.errors import APIError
from xinserve.server.http.auth import may_use
from xinserve.server.pool.model_pool import ModelPool

router = APIRouter(include_in_schema=False)
VERSION = "xinserve-0.1.0"


def _first_pool(request: Request) -> ModelPool:
    for pool in request.app.state.router.pools.values():
        if may_use(request, pool.name):
            return pool
    raise APIError(404, "No model is served to this key.", code="model_not_found")


def _paths(pool: ModelPool) -> tuple[str | None, str | None]:
    """Where the gateway can load the tokenizer: a hub id as configured (it downloads it itself),
    else the local directory (null until the model is resolved)."""
    settings = pool.settings
    if not settings.is_embedded and not Path(settings.path).expanduser().exists():
        return settings.path, settings.tokenizer or settings.path
    return pool.model_path, pool.tokenizer_path


@cache
def _hf_config(model_dir: str) -> dict[str, Any]:
    path = Path(model_dir).expanduser() / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


async def server_info(request: Request) -> dict[str, Any]:
    pool = _first_pool(request)
    model_path, tokenizer_path = _paths(pool)
    ready = pool.ready_workers()
    return {
        "served_model_name": pool.name,
        "model_path": model_path,
        "tokenizer_path": tokenizer_path,
        "version": VERSION,
        "dp_size": 1,  # the replicas of one server are balanced by the server itself
        "max_running_requests": pool.settings.max_num_seqs * len(pool.workers),
        "max_prefill_tokens": pool.settings.max_num_batched_tokens,
        "max_total_tokens": sum(w.info.get("kv_cache_tokens", 0) for w in ready) or None,
        "context_length": pool.max_model_len,
        # SGLang's PD fields (server/disagg/bootstrap.py): a prefill instance's bootstrap port is its KV side channel.
        "disaggregation_mode": _disaggregation_mode(ready),
        "disaggregation_bootstrap_port": bootstrap_port(ready[0].info) if ready else None,
    }


def _disaggregation_mode(workers: list[Any]) -> str:
    """SGLang's ``disaggregation_mode``: "prefill", "decode" or "null" (not disaggregated)."""
    role = ((workers[0].info.get("kv_transfer") or {}) if workers else {}).get("kv_role")
    return {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "decode"}.get(role, "null")


async def model_info(request: Request) -> dict[str, Any]:
    pool = _first_pool(request)
    model_path, tokenizer_path = _paths(pool)
    config = _hf_config(pool.model_path) if pool.model_path else {}
    return {
        "model_path": model_path,
        "tokenizer_path": tokenizer_path,
        "is_generation": True,
        "model_type": config.get("model_type"),
        "architectures": config.get("architectures"),
    }


@router.get("/get_load")
async def get_load(request: Request) -> list[dict[str, Any]]:
    """One entry (data-parallel rank 0) summing the server's workers: requests running and waiting,
    and the tokens their KV caches hold."""
    pool = _first_pool(request)
    running = waiting = tokens = 0
    for w in pool.ready_workers():
        if w.stats is not None:
            running += w.stats.num_running
            waiting += w.stats.num_waiting
            tokens += round(w.stats.kv_cache_usage * w.info.get("kv_cache_tokens", 0))
    return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": tokens}]


for _path in ("/server_info", "/get_server_info"):
    router.add_api_route(_path, server_info, methods=["GET"])
for _path in ("/model_info", "/get_model_info"):
    router.add_api_route(_path, model_info, methods=["GET"])
