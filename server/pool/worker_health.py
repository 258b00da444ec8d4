"""What /health shows of a worker: its engine statistics (the latest ``Stats`` message it sent), its ranks."""

from typing import Any

from xinserve.engines.core.outputs import EngineStats


def describe_stats(stats: EngineStats | None) -> dict[str, Any]:
    """Queue depths, KV-cache use, host-tier hits and speculation; None each before the first stats."""
    return {
        "num_requests_running": None if stats is None else stats.num_running,
        "num_requests_waiting": None if stats is None else stats.num_waiting,
        "kv_cache_usage": None if stats is None else stats.kv_cache_usage,
        "external_prefix_cache_hits_total": None if stats is None else stats.external_prefix_cache_hits_total,
        "speculative_decoding": _describe_spec_decode(stats),
        # prefill/decode disaggregation's transfers, live (info.kv_transfer is the connector as it started)
        "kv_transfer": None if stats is None else {
            "held_requests": stats.kv_transfer_held_requests, "sent_total": stats.kv_transfer_sent_total,
            "expired_total": stats.kv_transfer_expired_total, "failed_loads_total": stats.kv_transfer_failed_loads_total},
    }


def _describe_spec_decode(stats: EngineStats | None) -> dict[str, Any] | None:
    """The speculative method and its running acceptance (None with speculation off)."""
    spec = None if stats is None else stats.spec_decode
    if spec is None:
        return None
    rate = spec.acceptance_rate
    return {"method": spec.method, "acceptance_rate": None if rate is None else round(rate, 4),
            "num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens}


def describe_ranks(devices: list[str], info: dict[str, Any], pid: int | None, state: str,
                   dead: int | None) -> list[dict[str, Any]]:
    """Each rank's device, process and state: the replica's ``state``, or "dead" for rank ``dead``;
    ``info``: the replica's ``Ready`` info (its other ranks' processes), ``pid``: rank 0's process."""
    known = {r["rank"]: r for r in info.get("ranks", [])}
    ranks = []
    for rank, device in enumerate(devices):
        # tp rank, pp stage, expert range (engines/parallel/rank_role.py); None until the replica is ready
        ranks.append({"rank": rank, "device": device, "pid": known.get(rank, {}).get("pid") if rank else pid,
                      "state": "dead" if rank == dead else state, "role": known.get(rank, {}).get("role")})
    return ranks
