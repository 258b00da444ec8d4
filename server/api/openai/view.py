"""OpenAI response bodies and stream chunks, built as plain dicts.

Shapes follow the official schemas strictly: required-but-nullable fields are present as null
(``logprobs``, ``finish_reason`` in chunks, ``message.refusal``), optional objects are omitted rather
than null (``usage`` of a non-streamed response is always an object).
"""

from typing import Any

from xinserve.engines.core.outputs import TokenLogprob
from xinserve.engines.core.token_bytes import token_bytes_of


class TokenTexts:
    """Token id -> its text as it reads inside running text, cached (log-probs decode the same ids
    again and again).

    SentencePiece tokenizers drop a token's leading space when it is decoded on its own ("▁there"
    decodes to "there"), so each token is decoded after an anchor token and the anchor's own text is
    cut off: " there", as in the generated text, and the completions ``text_offset`` add up.
    ``raw(token_id)`` is the token's own bytes: a byte-fallback ``<0xF0>`` decodes to U+FFFD but is
    byte 0xF0.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes = token_bytes_of(tokenizer)
        anchor = tokenizer.encode("a", add_special_tokens=False)
        self._anchor = anchor[-1:] if anchor else []
        self._anchor_text = self._decode(self._anchor)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._decode([token_id])
            in_context = self._decode([*self._anchor, token_id])
            if self._anchor and in_context.startswith(self._anchor_text):
                text = in_context[len(self._anchor_text):]
            self._cache[token_id] = text
        return text

    def raw(self, token_id: int) -> list[int]:
        raw = self._bytes(token_id)
        return list(self(token_id).encode("utf-8") if raw is None else raw)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_entry(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": texts(token_id), "logprob": logprob, "bytes": texts.raw(token_id)}


def chat_logprobs(
    token_ids: list[int], entries: list[TokenLogprob] | None, texts: TokenTexts, top: int
) -> dict[str, Any] | None:
    if entries is None:
        return None
    content = []
    for token_id, lp in zip(token_ids, entries, strict=False):
        entry = _token_entry(texts, token_id, lp.logprob)
        entry["top_logprobs"] = [_token_entry(texts, t, v) for t, v in zip(lp.top_token_ids[:top], lp.top_logprobs[:top])]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    token_ids: list[int], entries: list[TokenLogprob] | None, texts: TokenTexts, offset: int
) -> dict[str, Any] | None:
    """The legacy completions format; ``offset`` is where this text starts in the choice's text."""
    if entries is None:
        return None
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, lp in zip(token_ids, entries, strict=False):
        text = texts(token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top_logprobs.append({texts(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def prompt_logprobs(
    token_ids: list[int], entries: list[TokenLogprob | None], texts: TokenTexts, offsets: list[int], echo: str
) -> dict[str, Any]:
    """The echoed prompt's tokens in the legacy completions format; the first has no log-prob.

    ``offsets``: where each token's text starts in the decoded prompt (``text_offsets``); they index
    the echoed text, so they stop at its end, where the completion's own offsets begin.
    """
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, lp, offset in zip(token_ids, entries, offsets, strict=False):
        tokens.append(texts(token_id))
        token_logprobs.append(None if lp is None else lp.logprob)
        top_logprobs.append(None if lp is None else {texts(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
        text_offset.append(min(offset, len(echo)))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def join_logprobs(first: dict[str, Any], second: dict[str, Any] | None) -> dict[str, Any]:
    """Two legacy log-prob blocks as one (the echoed prompt's, then the completion's)."""
    return first if second is None else {key: first[key] + second[key] for key in first}


def chat_completion(
    request_id: str, created: int, model: str, choices: list[dict[str, Any]], usage_: dict[str, int]
) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_choice(
    index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
    tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None,
) -> dict[str, Any]:
    message = {"role": "assistant", "content": text, "refusal": None}
    if reasoning is not None:
        message["reasoning_content"] = reasoning  # vLLM's extension field
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(
    request_id: str, created: int, model: str, choices: list[dict[str, Any]], *, with_usage: bool,
    usage_: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One stream chunk; with ``include_usage`` every chunk has ``usage`` (null but on the last)."""
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}
    if with_usage:
        chunk["usage"] = usage_
    return chunk


def chunk_choice(
    index: int, delta: dict[str, Any], finish_reason: str | None = None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(
    request_id: str, created: int, model: str, choices: list[dict[str, Any]], usage_: dict[str, int] | None
) -> dict[str, Any]:
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
