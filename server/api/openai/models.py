"""GET /v1/models and GET /v1/models/{id}: every configured model the key may use, with its context length,
and each model's LoRA adapters (server/lora/) as models of their own, ``parent`` naming the base model."""

from functools import partial
from typing import Any

from fastapi import APIRouter, Request

from xinserve.server.http.auth import may_use
from xinserve.server.pool.model_pool import ModelPool

router = APIRouter()


def model_card(pool: ModelPool, created: int) -> dict[str, Any]:
    card: dict[str, Any] = {"id": pool.name, "object": "model", "created": created, "owned_by": "xinserve"}
    # vLLM's extra field; absent (not null) while no worker has reported it yet.
    if pool.max_model_len is not None:
        card["max_model_len"] = pool.max_model_len
    return card


def adapter_card(pool: ModelPool, name: str, created: int) -> dict[str, Any]:
    """A LoRA adapter as vLLM lists one: ``root`` its directory, ``parent`` the model it runs on."""
    return {"id": name, "object": "model", "created": created, "owned_by": "xinserve",
            "root": pool.adapters[name], "parent": pool.name}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = request.app.state
    pools = [p for p in state.router.pools.values() if may_use(request, p.name)]
    cards = [card for p in pools
             for card in (model_card(p, state.created), *(adapter_card(p, a, state.created) for a in p.adapters))]
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    state = request.app.state
    target = state.router.resolve(model_id, partial(may_use, request))
    pool = state.router.pools[target.base]
    return model_card(pool, state.created) if target.lora_name is None else adapter_card(pool, model_id, state.created)
