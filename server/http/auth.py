"""API keys: ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``) compared in constant time
against every configured key.

The matching key's entry is left in ``request.state.api_key``: its name for the request log and the
per-key metrics, its ``models`` for ``may_use``. To a key limited to some models the others do not
exist: the same 404 as an unknown model (``Router.resolve``), and absent from ``/v1/models``; a LoRA
adapter is usable with its base model.
"""

import hmac

from fastapi import Request

from xinserve.server.config import ApiKey
from xinserve.server.errors import APIError


def match_key(presented: str, keys: list[ApiKey]) -> ApiKey | None:
    """The entry whose key equals ``presented``; the time taken does not depend on where they differ."""
    given = presented.encode()
    found = None
    for key in keys:
        # No short-circuit: every key is compared, so timing does not reveal which one matched.
        if hmac.compare_digest(given, key.secret.encode()):
            found = key
    return found


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def require_api_key(request: Request) -> None:
    """FastAPI dependency; a no-op when no keys are configured."""
    keys: list[ApiKey] = request.app.state.api_keys
    if not keys:
        return
    # Anthropic's SDKs send the key as ``x-api-key``; the same keys, scoping and limits apply.
    token = bearer_token(request.headers.get("authorization")) or request.headers.get("x-api-key") or None
    if token is None:
        raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")
    key = match_key(token, keys)
    if key is None:
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    request.state.api_key = key


def may_use(request: Request, model: str) -> bool:
    """Whether the request's key may use ``model`` (always, without auth or for an unlimited key)."""
    key: ApiKey | None = getattr(request.state, "api_key", None)
    return key is None or not key.models or model in key.models


def limited_key(request: Request) -> ApiKey | None:
    """The request's key when it is limited to some models; None for no key or an unlimited one."""
    key: ApiKey | None = getattr(request.state, "api_key", None)
    return key if key is not None and key.models else None
