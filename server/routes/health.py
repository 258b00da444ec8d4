"""GET /health: 200 when every worker is ready, else 503 with each worker's state and last error.

It reads only state the HTTP process already holds, so a busy or hung worker cannot block it.
"""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    pools = request.app.state.router.pools.values()
    workers = [w.describe() for pool in pools for w in pool.workers]
    problems = [pool.error for pool in pools if pool.error]
    tokenizers_loading = [pool.name for pool in pools if pool.tokenizer is None and not pool.error]
    ok = not problems and not tokenizers_loading and all(w["state"] == "ready" for w in workers)
    body = {"status": "ok" if ok else "unavailable", "workers": workers}
    if problems:
        body["errors"] = problems
    if tokenizers_loading:
        body["loading_tokenizers"] = tokenizers_loading
    return JSONResponse(body, status_code=200 if ok else 503)
