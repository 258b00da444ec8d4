"""vLLM's ``POST /score`` (also ``/v1/score``): a relevance score per pair of ``text_1`` and ``text_2``
(or ``queries`` and ``documents``): one against each of many, or pairwise."""

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from xinserve.server.api.common import ClientDisconnected
from xinserve.server.api.pooling.pair_scores import score_pairs
from xinserve.server.api.pooling.run import usage
from xinserve.server.errors import APIError

router = APIRouter()


class ScoreRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None  # the same as text_1
    documents: str | list[str] | None = None  # the same as text_2
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    user: str | None = None

    def pairs(self) -> list[tuple[str, str]]:
        first, second = self._side(self.text_1, self.queries, "text_1"), self._side(self.text_2, self.documents, "text_2")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise APIError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as "
                           "many as text_2.", param="text_1")
        return list(zip(first, second))

    @staticmethod
    def _side(value: str | list[str] | None, alias: str | list[str] | None, name: str) -> list[str]:
        if (value is None) == (alias is None):
            other = "queries" if name == "text_1" else "documents"
            raise APIError(400, f"give exactly one of '{name}' and '{other}'.", param=name)
        texts = [value or alias] if isinstance(value or alias, str) else list(value or alias)
        if not texts:
            raise APIError(400, f"'{name}' must not be empty.", param=name, code="empty_input")
        return texts


@router.post("/score", response_model=None)
@router.post("/v1/score", response_model=None)
async def score(body: ScoreRequest, request: Request) -> dict[str, Any] | Response:
    try:
        run, scores = await score_pairs(request, body.model, body.pairs(), body.truncate_prompt_tokens, "score",
                                        "text_2")
    except ClientDisconnected:
        return Response(status_code=499)
    data = [{"index": i, "object": "score", "score": value} for i, value in enumerate(scores)]
    return {"id": run.request_id, "object": "list", "created": int(time.time()), "model": run.model, "data": data,
            "usage": usage(run)}
