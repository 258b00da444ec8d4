"""vLLM's ``POST /rerank`` (also ``/v1/rerank``, ``/v2/rerank``) in Jina's and Cohere's shape: the
``documents`` scored against the ``query``, best first, ``top_n`` of them, each with its index, its
``relevance_score`` and (``return_documents``) its text."""

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from xinserve.server.api.common import ClientDisconnected
from xinserve.server.api.pooling.pair_scores import score_pairs
from xinserve.server.errors import APIError

router = APIRouter()


class DocumentObject(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    query: str
    documents: list[str | DocumentObject]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    user: str | None = None

    def texts(self) -> list[str]:
        if not self.documents:
            raise APIError(400, "'documents' must not be empty.", param="documents", code="empty_input")
        return [doc if isinstance(doc, str) else doc.text for doc in self.documents]


async def rerank(body: RerankRequest, request: Request) -> dict[str, Any] | Response:
    texts = body.texts()
    try:
        run, scores = await score_pairs(request, body.model, [(body.query, text) for text in texts],
                                        body.truncate_prompt_tokens, "rerank", "documents")
    except ClientDisconnected:
        return Response(status_code=499)
    order = sorted(range(len(texts)), key=lambda i: scores[i], reverse=True)[: body.top_n]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": texts[i]}} if body.return_documents
                                                              else {})} for i in order]
    return {"id": run.request_id, "model": run.model, "usage": {"total_tokens": run.prompt_tokens}, "results": results}


for _path in ("/rerank", "/v1/rerank", "/v2/rerank"):
    router.add_api_route(_path, rerank, methods=["POST"], response_model=None)
