"""A prefill/decode proxy speaking vLLM's disaggregation protocol (the shape of vLLM's
``toy_proxy_server.py`` and of llm-d's and vllm-ascend's proxies), for tests and small deployments:

    python -m xinserve.server.disagg.proxy --prefill http://p:8000 --decode http://d:8001 --port 9000

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to a prefill instance with
``max_tokens`` 1, no stream and ``kv_transfer_params: {"do_remote_decode": true, ...}``; the
``kv_transfer_params`` of its answer go with the original request to a decode instance, whose answer
(streamed or not) is the client's. Instances are taken in turn. An error from either is passed through.
"""

import argparse
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

# What the prefill leg sends: vLLM's proxies set every field, the remote ones still unknown.
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: one token, not streamed, asking the instance to hold its KV."""
    # One choice: the decode instance's choices all start from the one prompt KV it reads.
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "best_of")}
    leg.update(max_tokens=1, stream=False, n=1, kv_transfer_params=dict(PREFILL_PARAMS))
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "proxy_error", "param": None, "code": None}},
                        status_code=status)


def make_app(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    prefills, decodes = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(lifespan=lifespan)

    def forwarded(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-request-id")}

    async def relay(path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError as exc:
            return _error(400, f"the request body is not JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = forwarded(request)
        try:
            prefilled = await client.post(next(prefills) + path, json=prefill_request(body), headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"the prefill instance is unreachable: {exc}")
        if prefilled.status_code != 200:
            return Response(prefilled.content, prefilled.status_code, media_type="application/json")
        params = prefilled.json().get("kv_transfer_params")
        decode_body = body if params is None else {**body, "kv_transfer_params": params}
        try:
            answer = await client.send(client.build_request("POST", next(decodes) + path, json=decode_body,
                                                            headers=headers), stream=True)
        except httpx.HTTPError as exc:
            return _error(502, f"the decode instance is unreachable: {exc}")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()

        return StreamingResponse(chunks(), status_code=answer.status_code,
                                 media_type=answer.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await relay("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The decode instances serve the answers: their model list (the same models on every instance)."""
        try:
            listed = await client.get(next(decodes) + "/v1/models", headers=forwarded(request))
        except httpx.HTTPError as exc:
            return _error(502, f"the decode instance is unreachable: {exc}")
        return Response(listed.content, listed.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"prefill": prefill_urls, "decode": decode_urls}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="prefill/decode proxy (vLLM's disaggregation protocol)")
    parser.add_argument("--prefill", action="append", required=True, help="a prefill instance's base URL")
    parser.add_argument("--decode", action="append", required=True, help="a decode instance's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args(argv)
    strip = [url.rstrip("/") for url in args.prefill], [url.rstrip("/") for url in args.decode]
    uvicorn.run(make_app(*strip), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
