"""vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}`` and
``POST /v1/unload_lora_adapter`` ``{lora_name}``, answered with vLLM's plain-text "Success: ..." lines.

They exist only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` or ``XINSERVE_ALLOW_RUNTIME_LORA_UPDATING`` is
true (``1`` or ``true``) when the server starts; otherwise they are unknown paths (404), as in vLLM. API
keys apply as on every route, and a key limited to some models may load onto and unload from those
only. ``base_model_name`` (ours) picks the model when several serve LoRA adapters. Updates run one at a
time (a name is checked and taken under one lock).
"""

import asyncio
import os
from collections.abc import Mapping
from functools import partial
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from xinserve.server.errors import APIError
from xinserve.server.http.auth import may_use
from xinserve.server.lora.updates import load_adapter, unload_adapter
from xinserve.server.pool.model_pool import ModelPool
from xinserve.server.pool.router import Router

RUNTIME_UPDATING_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "XINSERVE_ALLOW_RUNTIME_LORA_UPDATING")

router = APIRouter()


def runtime_updating_allowed(env: Mapping[str, str]) -> bool:
    return any(env.get(name, "0").strip().lower() in ("1", "true") for name in RUNTIME_UPDATING_ENV)


def install(app: FastAPI, dependencies: list[Any], env: Mapping[str, str] | None = None) -> None:
    """Add the endpoints to ``app`` when the environment allows runtime updates."""
    if runtime_updating_allowed(os.environ if env is None else env):
        app.state.lora_updates = asyncio.Lock()
        app.include_router(router, dependencies=dependencies)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # as the generation endpoints' bodies


class LoadLoraAdapterRequest(_Body):
    lora_name: str | None = None
    lora_path: str | None = None
    base_model_name: str | None = None


class UnloadLoraAdapterRequest(_Body):
    lora_name: str | None = None


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> str:
    name, path = (body.lora_name or "").strip(), (body.lora_path or "").strip()
    if not name or not path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                       param="lora_path" if name else "lora_name", code="missing_required_parameter")
    state = request.app.state
    allowed = partial(may_use, request)
    async with state.lora_updates:
        _check_new_name(state.router, name)
        await load_adapter(_base_pool(state.router, body.base_model_name, allowed), name, path)
    return f"Success: LoRA adapter '{name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> str:
    name = (body.lora_name or "").strip()
    if not name:
        raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name",
                       code="missing_required_parameter")
    state = request.app.state
    async with state.lora_updates:
        base = state.router.adapter_base(name)
        if base is None or not may_use(request, base):
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="lora_adapter_not_found")
        await unload_adapter(state.router.pools[base], name)
    return f"Success: LoRA adapter '{name}' removed successfully."


def _check_new_name(models: Router, name: str) -> None:
    """A request's ``model`` names a served model or an adapter: a new adapter's name must be free."""
    if name in models.pools:
        raise APIError(400, f"'{name}' is the name of a served model; give the adapter another name.",
                       param="lora_name")
    if models.adapter_base(name) is not None:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")


def _base_pool(models: Router, base_model_name: str | None, allowed: Any) -> ModelPool:
    """The model a new adapter goes to: ``base_model_name``, else the one model with LoRA enabled."""
    if base_model_name is not None:
        if base_model_name not in models.pools or not allowed(base_model_name):
            raise APIError(404, f"The model '{base_model_name}' does not exist.", param="base_model_name",
                           code="model_not_found")
        pool = models.pools[base_model_name]
        if not pool.settings.enable_lora:
            raise APIError(400, f"Model '{pool.name}' does not serve LoRA adapters (start it with --enable-lora).",
                           param="base_model_name")
        return pool
    candidates = [p for p in models.pools.values() if p.settings.enable_lora and allowed(p.name)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise APIError(400, "No served model has LoRA enabled (start the server with --enable-lora).",
                       param="lora_name")
    raise APIError(400, f"Several models serve LoRA adapters ({', '.join(p.name for p in candidates)}): "
                        "name one as 'base_model_name'.", param="base_model_name")
