"""GET /health (readiness: can this server answer requests?) and GET /health/live (liveness).

``/health`` is 200 "ok" when every worker is ready; 200 "degraded" when some are not but every model
can still answer, itself or through its fallback chain; 503 "unavailable" when some model cannot
(also while models load); 503 "draining" during shutdown. It carries each model's state and each
worker's state, load, restarts and last error; the LoRA adapters of each model that serves them
(``lora_adapters``, and each worker's own). ``/health/live`` is 200 whenever the HTTP process
answers at all: a dead worker is restarted by the server itself, so an orchestrator should restart
the server only when this fails.

Both read only state the HTTP process already holds, so a busy or hung worker cannot block them.

When ``/health`` needs a key (it is not in ``auth_exempt_paths``), a key limited to some models sees
only those: their states, their workers and errors, and a status that says whether *its* models can
answer (a fallback it may not use does not count). An unlimited key, or an exempt path, sees all.
"""

from collections.abc import Callable
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from xinserve.server.http.auth import may_use
from xinserve.server.pool.router import Router

router = APIRouter()


def model_state(models: Router, name: str, allowed: Callable[[str], bool] | None = None) -> str:
    """"ready" (every worker), "degraded" (some), "fallback" (none, a fallback ``allowed`` answers),
    "unavailable"."""
    pool = models.pools[name]
    ready = len(pool.ready_workers())
    if ready:
        return "ready" if ready == len(pool.workers) else "degraded"
    if any(p.ready_workers() for p in models.chain(name, allowed)[1:]):
        return "fallback"
    return "unavailable"


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = request.app.state
    allowed = partial(may_use, request)
    pools = [pool for pool in state.router.pools.values() if allowed(pool.name)]
    models = {pool.name: model_state(state.router, pool.name, allowed) for pool in pools}
    if state.drain.draining:
        status = "draining"
    elif all(s == "ready" for s in models.values()):
        status = "ok"
    elif "unavailable" in models.values():
        status = "unavailable"
    else:
        status = "degraded"
    body = {"status": status, "models": models, "workers": [w.describe() for pool in pools for w in pool.workers]}
    adapters = {pool.name: sorted(pool.adapters) for pool in pools if pool.settings.enable_lora}
    if adapters:
        body["lora_adapters"] = adapters
    problems = [pool.error for pool in pools if pool.error]
    if problems:
        body["errors"] = problems
    tokenizers_loading = [pool.name for pool in pools if pool.tokenizer is None and not pool.error]
    if tokenizers_loading:
        body["loading_tokenizers"] = tokenizers_loading
    return JSONResponse(body, status_code=200 if status in ("ok", "degraded") else 503)


@router.get("/health/live")
async def live() -> dict[str, str]:
    return {"status": "alive"}
