"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

``/tokenize`` takes a ``prompt`` (encoded as /v1/completions encodes it) or chat ``messages`` (through
the chat template exactly as /v1/chat/completions renders them), so a client can count a request's
tokens before sending it. They use the model's own tokenizer (never a fallback's) in the HTTP process;
the key's model scoping and the prompt limits apply as for generation. ``/detokenize`` returns text that
``/tokenize`` turns back into the same ids where the tokenizer allows (server/api/tokenize/prompt_tokens.py): lm-eval's
text mode sends that text back for scoring.
"""

import asyncio
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from xinserve.server.api.chat_template import chat_prompt_ids
from xinserve.server.api.openai.protocol import ChatCompletionRequest, ChatMessage, Tool
from xinserve.server.api.tokenize.prompt_tokens import encode_prompt, prompt_text
from xinserve.server.errors import APIError
from xinserve.server.http.auth import may_use
from xinserve.server.http.limits import check_chat
from xinserve.server.pool.model_pool import ModelPool
from xinserve.server.pool.router import not_found

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # as the generation endpoints' bodies


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # for ``prompt``; a chat template writes its own
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _pool(request: Request, model: str | None) -> ModelPool:
    """The named model's pool (a LoRA adapter's: its base model's tokenizer), or the first the key may
    use; 404 as for an unknown model, 503 while its tokenizer loads."""
    models = request.app.state.router
    allowed = partial(may_use, request)
    if model is None:
        model = next((name for name in models.pools if allowed(name)), None)
        if model is None:
            raise not_found(str(model))
    pool = models.pools[models.resolve(model, allowed).base]
    if pool.tokenizer is None:
        raise APIError(503, f"The tokenizer of '{model}' is still loading (or failed); see /health.",
                       code="model_unavailable")
    return pool


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
    pool = _pool(request, body.model)
    limits = request.app.state.config.limits
    if body.messages is not None:
        chat = ChatCompletionRequest(
            model=pool.name, messages=body.messages, tools=body.tools,
            add_generation_prompt=body.add_generation_prompt, chat_template_kwargs=body.chat_template_kwargs,
        )
        check_chat(chat, limits)
        ids = await asyncio.to_thread(
            chat_prompt_ids, pool.tokenizer, chat, max_chars=limits.max_prompt_chars,
            trust_template=request.app.state.config.server.trust_request_chat_template,
        )
    else:
        if len(body.prompt) > limits.max_prompt_chars:
            raise APIError(400, f"Invalid 'prompt': the prompt is too long. Expected at most "
                           f"{limits.max_prompt_chars} characters, got {len(body.prompt)}.", param="prompt",
                           code="string_above_max_length")
        ids = await asyncio.to_thread(encode_prompt, pool.tokenizer, body.prompt, body.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": pool.max_model_len or pool.settings.max_model_len,
                           "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = pool.tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    pool = _pool(request, body.model)
    size = len(pool.tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{size - 1})", param="tokens")
    return {"prompt": await asyncio.to_thread(prompt_text, pool.tokenizer, body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> dict[str, Any]:
    """The tokenizer's own settings (its ``init_kwargs``, without file paths), its class, its chat
    template and special tokens, as vLLM returns them."""
    tokenizer = _pool(request, model).tokenizer
    info = {k: _plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
            if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "tokenizer_object")}
    info["tokenizer_class"] = hugging_face_class_name(tokenizer)
    info["model_max_length"] = _plain(tokenizer.model_max_length)
    info.update({name: _plain(value) for name, value in tokenizer.special_tokens_map.items()})
    if getattr(tokenizer, "chat_template", None):
        info["chat_template"] = tokenizer.chat_template
    return info


def hugging_face_class_name(tokenizer: Any) -> str:
    """The tokenizer's class as transformers 4 and vLLM name it. transformers 5 folded each
    ``XTokenizerFast`` into ``XTokenizer`` and renamed ``PreTrainedTokenizerFast`` to
    ``TokenizersBackend``, keeping the old names as aliases: report the alias, the name a tokenizer
    config holds and clients know (lm-eval, vLLM's /tokenizer_info)."""
    import transformers  # loaded already: the tokenizer is one of its classes

    cls = type(tokenizer)
    for name in (f"{cls.__name__}Fast", "PreTrainedTokenizerFast"):
        if getattr(transformers, name, None) is cls:
            return name
    return cls.__name__


def _plain(value: Any) -> Any:
    """JSON-safe: added tokens as their text, containers element-wise, other objects as text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
