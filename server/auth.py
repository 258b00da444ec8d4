"""API-key check: ``Authorization: Bearer <key>`` compared in constant time against every key."""

import hmac

from fastapi import Request

from server.errors import APIError


def key_matches(presented: str, keys: list[str]) -> bool:
    """True if ``presented`` equals one of ``keys``; the time taken does not depend on where they differ."""
    given = presented.encode()
    found = False
    for key in keys:
        # No short-circuit: every key is compared, so timing does not reveal which one matched.
        found |= hmac.compare_digest(given, key.encode())
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
    keys: list[str] = request.app.state.api_keys
    if not keys:
        return
    token = bearer_token(request.headers.get("authorization"))
    if token is None:
        raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")
    if not key_matches(token, keys):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
