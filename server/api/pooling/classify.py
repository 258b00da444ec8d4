"""vLLM's ``POST /classify``: a sequence classifier's label probabilities per input (softmax; a
one-label head's sigmoid), the most likely label's name from the model's ``id2label``."""

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from xinserve.engines.pooling.params import PoolingParams
from xinserve.server.api.common import ClientDisconnected
from xinserve.server.api.pooling.inputs import input_list
from xinserve.server.api.pooling.run import run_pooling, usage

router = APIRouter()


class ClassificationRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    activation: bool = True  # False: the raw logits
    user: str | None = None


@router.post("/classify", response_model=None)
async def classify(body: ClassificationRequest, request: Request) -> dict[str, Any] | Response:
    try:
        run = await run_pooling(request, body.model, input_list(body.input), PoolingParams(
            "classify", activation=body.activation), prefix="classify", truncate_prompt_tokens=body.truncate_prompt_tokens)
    except ClientDisconnected:
        return Response(status_code=499)
    data = []
    for i, probs in enumerate(run.outputs):
        best = max(range(len(probs)), key=probs.__getitem__)
        label = run.labels[best] if run.labels and best < len(run.labels) else f"LABEL_{best}"
        data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
    return {"id": run.request_id, "object": "list", "created": int(time.time()), "model": run.model, "data": data,
            "usage": usage(run)}
