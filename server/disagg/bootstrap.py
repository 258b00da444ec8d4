"""SGLang's prefill/decode protocol, as ``sglang-router --pd-disaggregation`` speaks it, turned into vLLM's
(docs/disaggregation.md): the gateway sends the same request to a prefill and a decode instance at once,
with ``bootstrap_host`` (the prefill instance's host), ``bootstrap_port`` (its ``disaggregation_bootstrap_port``
in ``/server_info``: here its KV side channel) and a random ``bootstrap_room``.

- On a ``kv_producer`` the request becomes a one-token prefill whose blocks are held under its room
  (``kv_transfer_params: {"do_remote_decode": true, "bootstrap_room": ...}``). The gateway drains its answer.
- On a ``kv_consumer`` (or ``kv_both``) the room is looked up on the prefill instance's side channel until
  that prefill has finished (``bootstrap_timeout_s``); the ``kv_transfer_params`` it answers are then the
  request's, and the engine reads the blocks as for vLLM's proxies. Here, in the HTTP process, so that
  waiting for a prefill never stalls the engine's steps. A prefill instance that does not answer, or a room
  that never shows up, follows ``kv_load_failure_policy``: the decode instance computes the prompt itself
  (``recompute``) or the request is a 500 (``fail``). A room whose prefill stopped on its first token
  handed nothing over: the prompt is computed here, as vLLM's protocol does.
"""

import asyncio
import logging
import time
from typing import Any

from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.kv.side_channel import TransferFailed, ask
from xinserve.server.errors import APIError

logger = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 14579  # kv_transfer_config's default kv_port, for a gateway that sends none
POLL_S = 0.02  # between lookups of a room whose prefill has not finished yet


def bootstrap_port(worker_info: dict[str, Any]) -> int | None:
    """What ``/server_info`` reports as ``disaggregation_bootstrap_port``: a producer's side channel port."""
    transfer = worker_info.get("kv_transfer") or {}
    if transfer.get("kv_role") not in ("kv_producer", "kv_both"):
        return None
    return int(transfer["side_channel"].rsplit(":", 1)[1])


async def apply_bootstrap(fields: Any, params: SamplingParams, worker_info: dict[str, Any]) -> None:
    """Set ``params`` for a request carrying SGLang's bootstrap fields (``fields``: the request body)."""
    room = fields.bootstrap_room
    if room is None:
        return
    transfer = worker_info.get("kv_transfer")
    if transfer is None:
        raise APIError(400, "bootstrap_room needs an instance started with --kv-transfer-config",
                       param="bootstrap_room")
    if not 0 <= room < 2**64:
        raise APIError(400, f"bootstrap_room must be in [0, 2**64), got {room}", param="bootstrap_room")
    if fields.kv_transfer_params is not None:
        raise APIError(400, "send kv_transfer_params or SGLang's bootstrap fields, not both",
                       param="kv_transfer_params")
    if transfer["kv_role"] == "kv_producer":
        # SGLang's prefill instances compute the prompt and its first token only.
        params.max_tokens = 1
        params.min_tokens = 0
        params.kv_transfer_params = {"do_remote_decode": True, "bootstrap_room": room}
        return
    if not fields.bootstrap_host:
        raise APIError(400, "bootstrap_host is missing", param="bootstrap_host")
    port = fields.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
    if not 0 < port < 65536:
        raise APIError(400, f"bootstrap_port must be a TCP port, got {port}", param="bootstrap_port")
    address = f"tcp://{fields.bootstrap_host}:{port}"
    try:
        params.kv_transfer_params = await asyncio.to_thread(_wait_for_room, address, room, transfer)
    except TransferFailed as exc:
        logger.warning("bootstrap_room %d: %s", room, exc)
        if transfer["kv_load_failure_policy"] == "fail":
            raise APIError(500, f"the KV cache of bootstrap_room {room} could not be loaded from the prefill "
                                f"instance ({exc}; kv_load_failure_policy fail)") from None


def _wait_for_room(address: str, room: int, transfer: dict[str, Any]) -> dict[str, Any] | None:
    """The prefill's ``kv_transfer_params`` for ``room`` once it has finished; None when it handed nothing
    over (the prompt is computed here). Raises ``TransferFailed`` when it cannot be had."""
    deadline = time.monotonic() + transfer["bootstrap_timeout_s"]
    while True:
        reply = ask(address, {"op": "lookup", "room": room}, transfer["handshake_timeout_s"])
        if reply.get("ok"):
            return reply["kv_transfer_params"]
        if not reply.get("pending"):
            logger.info("bootstrap_room %d: %s; computing the prompt here", room, reply.get("error"))
            return None
        if time.monotonic() >= deadline:
            raise TransferFailed(f"no prefill of bootstrap_room {room} finished within "
                                 f"{transfer['bootstrap_timeout_s']:g}s")
        time.sleep(POLL_S)
