"""The relevance score of (query, document) pairs, shared by /score and /rerank. A cross-encoder
(convert classify: a one-label classifier, or a reranker scored by two tokens) reads each pair
encoded as the tokenizer encodes a text pair; an embedding model scores the cosine similarity of the
two texts' embeddings (as vLLM does)."""

import math
from typing import Any

from fastapi import Request

from xinserve.engines.pooling.params import PoolingParams
from xinserve.server.api.pooling.run import PoolingRun, run_pooling, served_task
from xinserve.server.errors import APIError


def _one_score(info: dict[str, Any]) -> None:
    labels = info.get("labels")
    if info["task"] == "classify" and labels and len(labels) != 1:
        raise APIError(400, f"scoring needs a model with one score: this classifier has {len(labels)} labels.",
                       param="model", code="model_not_supported")


def _pair_ids(tokenizer: Any, pairs: list[tuple[str, str]]) -> list[list[int]]:
    return [list(tokenizer(query, text_pair=document)["input_ids"]) for query, document in pairs]


async def score_pairs(request: Request, model: str, pairs: list[tuple[str, str]], truncate_prompt_tokens: int | None,
                      prefix: str, param: str) -> tuple[PoolingRun, list[float]]:
    """The run and one score per pair, in order."""
    if served_task(request, model) == "embed":
        texts = sorted({text for pair in pairs for text in pair})
        run = await run_pooling(request, model, list(texts), PoolingParams("embed"), prefix=prefix,
                                truncate_prompt_tokens=truncate_prompt_tokens, param=param)
        vectors = dict(zip(texts, run.outputs))
        return run, [_cosine(vectors[query], vectors[document]) for query, document in pairs]
    texts = [f"{query}{document}" for query, document in pairs]  # the size checks: the pairs' characters

    def encode(tokenizer: Any) -> list[list[int]]:
        return _pair_ids(tokenizer, pairs)

    run = await run_pooling(request, model, texts, PoolingParams("classify"), prefix=prefix,
                            truncate_prompt_tokens=truncate_prompt_tokens, param=param, check_model=_one_score,
                            encode=encode)
    return run, [output[0] for output in run.outputs]


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)

