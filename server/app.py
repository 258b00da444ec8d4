"""``create_app(config)``: the FastAPI application, its worker pools and their lifetime.

The app starts serving at once; models load in the background (``/health`` says 503
"unavailable" until every model has a ready worker), so orchestrators can probe it while weights
load. Shutdown drains first (``xinserve.server.http.drain``, driven by ``xinserve.server.http.graceful`` on SIGTERM).
"""

import asyncio
import contextlib
import itertools
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from functools import partial

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_fastapi_instrumentator import Instrumentator

from xinserve.server.api import anthropic, health
from xinserve.server.api.openai import chat, completions, models
from xinserve.server.api.pooling import classify, embeddings, rerank, score
from xinserve.server.api.responses import routes as responses_api
from xinserve.server.api.responses.store import ResponseStore
from xinserve.server.api.sglang import routes as sglang_worker
from xinserve.server.api.sse import DirectSendMiddleware
from xinserve.server.api.tokenize import routes as tokenize
from xinserve.server.config import AppConfig
from xinserve.server.errors import InternalErrorMiddleware, install_error_handlers
from xinserve.server.http.auth import limited_key, require_api_key
from xinserve.server.http.body_limit import BodyLimitMiddleware
from xinserve.server.http.docs import add_docs
from xinserve.server.http.drain import Drain, DrainMiddleware
from xinserve.server.http.key_usage import KeyUsageMiddleware
from xinserve.server.http.metrics import (
    EngineStatsCollector,
    KeyMetrics,
    LimitedKeyView,
    LoraMetrics,
    RequestMetrics,
)
from xinserve.server.http.request_log import RequestLogMiddleware
from xinserve.server.lora import routes as lora_routes
from xinserve.server.pool.model_pool import ModelPool, cpu_thread_share, default_cpu_threads, local_cpu_ranks
from xinserve.server.pool.router import Router
from xinserve.server.pool.startup import stop_if_nothing_loads

logger = logging.getLogger("xinserve.server")


def create_app(config: AppConfig, log_level: int = logging.INFO) -> FastAPI:
    # CPU ranks on this node (a tensor-parallel group on CPU counts each rank)
    num_cpu_workers = sum(local_cpu_ranks(g, config.distributed) for m in config.models for g in m.groups)
    threads = default_cpu_threads(num_cpu_workers)
    first_groups = itertools.accumulate([len(m.groups) for m in config.models], initial=0)
    pools = {m.name: ModelPool(m, threads, log_level, config.distributed, first,
                               heartbeat_timeout_s=config.server.heartbeat_timeout_s,
                               max_cpu_threads=cpu_thread_share(num_cpu_workers))
             for m, first in zip(config.models, first_groups)}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ipc_dir = tempfile.mkdtemp(prefix="xinserve-ipc-")
        starts = [asyncio.create_task(pool.start(ipc_dir)) for pool in pools.values()]
        starts.append(asyncio.create_task(stop_if_nothing_loads(list(pools.values()), app.state.stop)))
        try:
            yield
        finally:
            for task in starts:
                task.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            await asyncio.gather(*(p.close(config.server.shutdown_timeout_s) for p in pools.values()))
            shutil.rmtree(ipc_dir, ignore_errors=True)
            logger.info("all workers stopped")

    # The API description and its pages are added by add_docs, behind the key check like the rest.
    app = FastAPI(title="xinserve", version="0.1.0", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)
    app.state.config = config
    app.state.router = Router(pools)
    app.state.drain = Drain(pools.values())
    # What ends the server when no worker can start; the CLI points it at uvicorn (see serve()).
    app.state.fatal_error = None
    app.state.stop = partial(setattr, app.state, "fatal_error")
    app.state.api_keys = config.server.named_keys()
    app.state.created = int(time.time())
    stored = config.responses_store
    app.state.response_store = ResponseStore(stored.max_entries_per_key, stored.max_bytes_per_key, stored.ttl_s)
    registry = CollectorRegistry()
    prefix = config.metrics.prefix
    registry.register(EngineStatsCollector(pools, prefix))
    app.state.metrics = RequestMetrics(registry, prefix)
    app.state.registry = registry

    install_error_handlers(app)
    guarded = [Depends(require_api_key)]
    exempt = set(config.server.auth_exempt_paths)
    app.include_router(chat.router, dependencies=guarded)
    app.include_router(completions.router, dependencies=guarded)
    app.include_router(models.router, dependencies=guarded)
    app.include_router(anthropic.router, dependencies=guarded)
    app.include_router(tokenize.router, dependencies=guarded)
    for pooling in (embeddings, classify, score, rerank):
        app.include_router(pooling.router, dependencies=guarded)
    app.include_router(responses_api.router, dependencies=guarded)
    app.include_router(sglang_worker.router, dependencies=guarded)
    lora_routes.install(app, guarded)  # only when runtime LoRA updates are allowed
    app.include_router(health.router, dependencies=[] if "/health" in exempt else guarded)
    add_docs(app, lambda path: [] if path in exempt else guarded)
    if config.monitoring.metrics:
        Instrumentator(registry=registry, excluded_handlers=["/metrics"]).instrument(app)

        async def metrics_endpoint(request: Request) -> Response:
            # A key limited to some models does not see the others' series (when /metrics needs a key).
            key = limited_key(request)
            view = registry if key is None else LimitedKeyView(registry, key.models, key.name)
            return Response(generate_latest(view), media_type=CONTENT_TYPE_LATEST)

        app.add_api_route(
            "/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False,
            dependencies=[] if "/metrics" in exempt else guarded,
        )
    # Added before the request log, so it runs inside it: a 413 is logged with its request id.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.limits.max_body_bytes)
    # Inside the request log too (a refusal is logged), outside the rest (a refused body is not read).
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.add_middleware(KeyUsageMiddleware, metrics=KeyMetrics(registry, prefix), loras=LoraMetrics(registry, prefix))
    app.add_middleware(RequestLogMiddleware)
    # Outside the request log (which sees the exception, and logs the request as a 500), inside the
    # Anthropic shape (which reshapes that 500).
    app.add_middleware(InternalErrorMiddleware)
    # Outermost: every error on /v1/messages paths, whichever layer raised it, in Anthropic's shape.
    app.add_middleware(anthropic.AnthropicErrorMiddleware)
    # Outside every other middleware of ours: stream chunks skip their send wrappers (server/api/sse.py).
    app.add_middleware(DirectSendMiddleware)
    return app
