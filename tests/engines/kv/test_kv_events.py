"""KV-cache events: the block manager records vLLM's BlockStored / BlockRemoved / AllBlocksCleared with
chained block hashes, and an engine publishes them per step over ZeroMQ (topic, sequence number,
msgpack batch) with replay of missed batches. The subscriber side here is written from vLLM's
documented schema (its examples/online_serving/kv_events_subscriber.py), not from our structs."""

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from tests.engines.core.test_kv_cache import admit, make_seq
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.core.kv_cache import BlockManager, chain_hash
from xinserve.engines.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventsConfig,
    offset_endpoint,
)


# vLLM's documented wire schema, as a subscriber declares it.
class VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VBlockRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VAllBlocksCleared(VEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(VKVEventBatch)


def test_stored_then_removed_with_chained_hashes_then_cleared():
    bm = BlockManager(num_blocks=4, block_size=2, record_events=True)
    a = make_seq([1, 2, 3, 4, 5], 0)
    admit(bm, a)
    (stored,) = bm.take_events()
    h1 = chain_hash(None, [1, 2])
    assert stored == BlockStored([h1, chain_hash(h1, [3, 4])], None, [1, 2, 3, 4], 2, None, "GPU")
    bm.free(a)
    b = make_seq([1, 2, 7, 8, 9, 9, 9], 1)  # reuses block [1, 2], then needs 3 more: evicts [3, 4]
    admit(bm, b)
    removed, stored_b = bm.take_events()
    assert removed == BlockRemoved([chain_hash(h1, [3, 4])], "GPU")
    assert stored_b.parent_block_hash == h1 and stored_b.token_ids == [7, 8, 9, 9]
    assert bm.take_events() == []
    bm.reset_prefix_cache()
    assert bm.take_events() == [AllBlocksCleared()]


def test_a_block_already_cached_elsewhere_is_not_stored_twice():
    bm = BlockManager(num_blocks=8, block_size=2, record_events=True)
    a, b = make_seq([1, 2, 3], 0), make_seq([1, 2, 3], 1)
    for seq in (a, b):  # both computed in one step: neither hit the other's block
        assert bm.allocate_slots(seq, 3)
        seq.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert [e.block_hashes for e in bm.take_events()] == [[chain_hash(None, [1, 2])]]


def test_events_encode_as_vllm_documents_them():
    ours = EventBatch(2.0, [BlockStored([7], None, [1, 2], 2, None, "GPU"), BlockRemoved([7], "GPU"),
                            AllBlocksCleared()], 3)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(ours))
    assert raw == [2.0, [["BlockStored", [7], None, [1, 2], 2, None, "GPU"], ["BlockRemoved", [7], "GPU"],
                         ["AllBlocksCleared"]], 3]
    theirs = DECODER.decode(msgspec.msgpack.encode(ours))
    assert theirs.data_parallel_rank == 3 and isinstance(theirs.events[2], VAllBlocksCleared)


def test_config_is_vllms_json_and_endpoints_offset_by_replica():
    config = KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"})
    assert config.publishes and config.endpoint == "tcp://*:5557" and config.buffer_steps == 10_000
    with pytest.raises(ValueError, match="unknown key"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "endpiont": "tcp://*:1"})
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse({"publisher": "kafka"})
    with pytest.raises(ValueError, match="true or false"):
        KVEventsConfig.parse({"enable_kv_cache_events": "false"})
    assert KVEventsConfig.parse({"enable_kv_cache_events": True}).publishes  # zmq unless told otherwise
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).publishes
    assert not KVEventsConfig.parse({"publisher": "zmq"}).publishes  # not enabled
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"


def replay_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A DEALER to the ROUTER replay socket: a REQ (vLLM's example) takes only the first of the replies
    to one request, so the client that wants every missed batch speaks REQ's envelope over a DEALER."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    return sock


def replay(sock: zmq.Socket, first: int) -> list[tuple[int, bytes]]:
    """Every buffered (seq, payload) from ``first`` on, up to the end marker (-1, b"")."""
    sock.send_multipart((b"", first.to_bytes(8, "big")))
    batches = []
    while sock.poll(10_000):
        empty, seq_bytes, payload = sock.recv_multipart()
        assert empty == b""
        if not payload:
            assert int.from_bytes(seq_bytes, "big", signed=True) == -1
            return batches
        batches.append((int.from_bytes(seq_bytes, "big"), payload))
    raise AssertionError("no end of replay")


class Subscriber:
    """vLLM's documented subscriber: SUB on (topic, seq, payload), the replay socket asked from the
    first missed sequence number on a gap."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str, topic: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.topic = topic.encode()
        self.replay = replay_socket(ctx, replay_endpoint)
        self.last_seq = -1
        self.batches: list[VKVEventBatch] = []
        self.replayed: list[int] = []  # sequence numbers that came from the replay socket

    def receive(self, timeout_ms: int) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic == self.topic
        seq = int.from_bytes(seq_bytes, "big")
        if seq > self.last_seq + 1:
            for replay_seq, replayed in replay(self.replay, self.last_seq + 1):
                if self.last_seq < replay_seq < seq:
                    self.batches.append(DECODER.decode(replayed))
                    self.replayed.append(replay_seq)
                    self.last_seq = replay_seq
        assert seq == self.last_seq + 1, "the replay filled the gap"
        self.batches.append(DECODER.decode(payload))
        self.last_seq = seq
        return True

    def events(self) -> list[Any]:
        return [e for b in self.batches for e in b.events]


def test_a_subscriber_sees_an_evicted_prompt_stored_then_removed_and_replays_what_it_missed(
        tiny_model_dir: Path, tmp_path: Path):
    endpoint, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": replay, "topic": "kv"}
    params = SamplingParams(temperature=0, max_tokens=2)
    prompt = list(range(10, 50))  # 40 tokens: 2 full blocks of 16 cached
    ctx = zmq.Context()
    with LLM(tiny_model_dir, num_kv_blocks=8, block_size=16, kv_events_config=config,
             data_parallel_rank=1) as llm:
        llm.generate(prompt, params)  # published before anyone subscribed: only replay can recover it
        sent = llm.engine.kv_events._buffer  # the publisher's thread sends it a little after the step
        for _ in range(500):
            if sent:
                break
            time.sleep(0.01)
        assert sent, "the first prompt's batch was sent before the subscriber connected"
        sub = Subscriber(ctx, offset_endpoint(endpoint, 1), offset_endpoint(replay, 1), "kv")
        received = False
        for i in range(50):  # a PUB drops what it sends before the subscription arrives: send until one lands
            llm.generate([200 + i] * 20, params)
            received = sub.receive(200)
            if received:
                break
        assert received and sub.replayed and sub.replayed[0] == 0
        # Two prompts of 7 blocks each evict the first prompt's cached blocks.
        llm.generate([[300 + i for i in range(100)], [400 + i for i in range(100)]], params)
        first = chain_hash(None, prompt[:16])
        while not any(isinstance(e, VBlockRemoved) and first in e.block_hashes for e in sub.events()):
            assert sub.receive(5000), "the removal of the first prompt's blocks was published"
    sub.sub.close(linger=0)
    sub.replay.close(linger=0)
    ctx.term()
    assert all(b.data_parallel_rank == 1 for b in sub.batches)
    hashes = [first, chain_hash(first, prompt[16:32])]
    events = sub.events()
    stored_at = next(i for i, e in enumerate(events) if isinstance(e, VBlockStored) and e.block_hashes == hashes)
    assert events[stored_at].parent_block_hash is None and events[stored_at].token_ids == prompt[:32]
    assert events[stored_at].block_size == 16
    removed = [i for i, e in enumerate(events) if isinstance(e, VBlockRemoved) and set(e.block_hashes) & set(hashes)]
    assert removed and min(removed) > stored_at
