"""GET /v1/models and GET /v1/models/{id}: every configured model the key may use, with its context length."""

from typing import Any

from fastapi import APIRouter, Request

from xinserve.server.errors import APIError
from xinserve.server.http.auth import may_use
from xinserve.server.pool.model_pool import ModelPool

router = APIRouter()


def model_card(pool: ModelPool, created: int) -> dict[str, Any]:
    card: dict[str, Any] = {"id": pool.name, "object": "model", "created": created, "owned_by": "xinserve"}
    # vLLM's extra field; absent (not null) while no worker has reported it yet.
    if pool.max_model_len is not None:
        card["max_model_len"] = pool.max_model_len
    return card


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = request.app.state
    pools = [p for p in state.router.pools.values() if may_use(request, p.name)]
    return {"object": "list", "data": [model_card(p, state.created) for p in pools]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    state = request.app.state
    pool = state.router.pools.get(model_id)
    if pool is None or not may_use(request, model_id):
        raise APIError(404, f"The model '{model_id}' does not exist.", param="model", code="model_not_found")
    return model_card(pool, state.created)
