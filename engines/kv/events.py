"""KV-cache events in vLLM's wire schema, so prefix-aware routers that index vLLM replicas index ours too.

The block manager records ``BlockStored`` when full blocks enter its prefix cache and ``BlockRemoved``
when a cached block is evicted; ``AllBlocksCleared`` when the whole cache is dropped. The engine sends
each step's events as one ``EventBatch`` (engines/kv/event_publisher.py). The records are msgspec structs
encoded as msgpack arrays in field order, each event tagged with its class name — the layout of
vLLM's ``vllm/distributed/kv_events.py`` (written from its documented schema, not copied). No torch.

Block hashes chain like the prefix cache's (engines/core/kv_cache.py ``chain_hash``): a block's hash covers
its tokens and the hash of the block before it; ``parent_block_hash`` is the hash before the first
block of an event (None at the start of a prompt).
"""

from dataclasses import dataclass, fields
from typing import Any

import msgspec

MEDIUM_DEVICE = "GPU"  # vLLM's medium name for the accelerator's own KV pool (whatever the accelerator)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the step's events were published
    events: list[Any]
    data_parallel_rank: int | None = None  # which replica of the model (its worker's index in the pool)


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """An event: tagged with its class name (the first array element on the wire)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]  # every block's tokens, concatenated (block_size per block)
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


@dataclass(slots=True, frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` JSON, same keys and defaults (``publisher`` "null" publishes nothing;
    unset, it is "zmq" when events are enabled, as in recent vLLM)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"
    endpoint: str = "tcp://*:5557"  # PUB socket: bound when it holds "*" or is ipc/inproc, else connected
    replay_endpoint: str | None = None  # ROUTER socket that answers replay requests
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches queued for the publishing thread
    topic: str = ""

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "KVEventsConfig":
        """From the JSON object; ValueError naming an unknown key or a bad value."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        enabled = data.get("enable_kv_cache_events", False)
        if enabled is not True and enabled is not False:  # JSON true or false only: "false" is truthy
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false")
        config = cls(**data)
        if config.publisher not in ("zmq", "null", None):
            raise ValueError(f"kv_events_config.publisher must be zmq or null, got {config.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(config, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be a positive integer, got {value!r}")
        not_text = [name for name in ("endpoint", "topic") if not isinstance(getattr(config, name), str)]
        if not_text:
            raise ValueError(f"kv_events_config.{not_text[0]} must be a string")
        return config

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher in ("zmq", None)


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Replica ``data_parallel_rank``'s endpoint, as vLLM offsets it: a TCP port plus the rank, an
    inproc/ipc name with ``_dp<rank>`` appended; rank 0 keeps the endpoint as given."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"kv events endpoint must be tcp://, ipc:// or inproc://, got {endpoint!r}")
