"""OpenAI's ``POST /v1/embeddings`` and vLLM's ``POST /pooling`` (the same inputs, the raw vector in
vLLM's shape). ``encoding_format`` base64: the float32 values' little-endian bytes, as OpenAI sends
them (the SDK decodes them with numpy); ``dimensions``: a Matryoshka model's first N values, normalized
again (a 400 where the model declares no Matryoshka support)."""

import base64
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from xinserve.engines.pooling.params import PoolingParams
from xinserve.server.api.common import ClientDisconnected
from xinserve.server.api.pooling.inputs import input_list
from xinserve.server.api.pooling.run import PoolingRun, run_pooling, usage

router = APIRouter()


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # as the generation endpoints' bodies

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    normalize: bool | None = None

    def params(self) -> PoolingParams:
        return PoolingParams("embed", self.dimensions, self.normalize)


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def _respond(body: EmbeddingRequest, request: Request, prefix: str,
                   item: Callable[[int, list[float] | str], dict[str, Any]],
                   head: Callable[[PoolingRun], dict[str, Any]]) -> dict[str, Any] | Response:
    """Run the request and answer ``head(run)`` with ``data``: ``item(index, encoded vector)`` per input."""
    try:
        run = await run_pooling(request, body.model, input_list(body.input), body.params(), prefix=prefix,
                                truncate_prompt_tokens=body.truncate_prompt_tokens)
    except ClientDisconnected:
        return Response(status_code=499)
    data = [item(i, encode(vector, body.encoding_format)) for i, vector in enumerate(run.outputs)]
    return {**head(run), "data": data, "usage": usage(run)}


@router.post("/v1/embeddings", response_model=None)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any] | Response:
    return await _respond(body, request, "embd",
                          lambda i, vector: {"object": "embedding", "embedding": vector, "index": i},
                          lambda run: {"object": "list", "model": run.model})


@router.post("/pooling", response_model=None)
async def create_pooling(body: EmbeddingRequest, request: Request) -> dict[str, Any] | Response:
    return await _respond(body, request, "pool", lambda i, vector: {"index": i, "object": "pooling", "data": vector},
                          lambda run: {"id": run.request_id, "object": "list", "created": int(time.time()),
                                       "model": run.model})
