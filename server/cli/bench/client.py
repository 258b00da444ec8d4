"""One streamed request and what the client saw of it: when each piece of text came, and the usage.

The client is aiohttp: the load generator shares the machine with the server it measures, and per
streamed chunk aiohttp's C parser costs a fraction of httpx's pure-Python stack (httpcore, h11, anyio),
which at concurrency 32 took most of a core on a 2-core machine (the client's CPU per level is in its
JSON: ``client_cpu_s``).
"""

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass(slots=True)
class RequestResult:
    ok: bool
    category: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first text
    latency: float = 0.0  # seconds from sending to the end of the stream
    itls: list[float] = field(default_factory=list)  # seconds between successive pieces of text
    error: str = ""


def _chunk_has_text(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            return True
    return False


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], category: str | None = None
) -> RequestResult:
    """POST ``body`` (a streaming request) and time its chunks; never raises for a failed request.

    Token counts come from the final ``usage`` chunk (``stream_options.include_usage``); a server
    that sends none is counted one token per chunk with text.
    """
    start = time.perf_counter()
    result = RequestResult(ok=False, category=category)
    last = None
    text_chunks = 0
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = await response.text(errors="replace")
                result.error = f"HTTP {response.status}: {text[:200]}"
                return result
            async for line in response.content:  # one line per iteration, its newline kept
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {chunk['error'].get('message', '')[:200]}"
                    return result
                now = time.perf_counter()
                if _chunk_has_text(chunk):
                    text_chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    # ValueError: a frame that is not JSON (json.JSONDecodeError), or a line past aiohttp's length limit
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    if last is None:  # nothing but an end (an immediate EOS): the first "token" came at the end
        result.ttft = result.latency
    result.output_tokens = result.output_tokens or text_chunks
    result.ok = True
    return result
