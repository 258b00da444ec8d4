"""Prefill/decode disaggregation over the Mooncake transfer engine: vLLM's ``"kv_connector":
"MooncakeConnector"`` and the request protocol of vLLM's disaggregation proxies (docs/disaggregation.md).

Producer (``kv_producer`` / ``kv_both``, the prefill instance): a request whose ``kv_transfer_params`` say
``do_remote_decode`` runs as any other (the proxy sends ``max_tokens`` 1); when it ends by length its blocks
stay held (``request_finished``) and its response carries the params the decode instance needs
(``remote_engine_id``, ``remote_block_ids``, ``remote_host`` / ``remote_port``: the side channel,
``remote_request_id``). They are held until read or ``hold_timeout_s`` (engines/kv/side_channel.py).

Consumer (``kv_consumer`` / ``kv_both``, the decode instance): a request whose params say
``do_remote_prefill`` is admitted with its prompt but the last token counted as loaded: its blocks are read
from the producer's pool before the step's forward (``start_load_kv``: acquire over the side channel, one
``batch_transfer_sync_read`` of every block run in every layer view, release), and only the last prompt
token is computed, which yields the first output token as a single instance would. A read that fails
leaves the blocks in ``get_block_ids_with_load_errors`` (the engine recomputes or fails the request).

The transfer engine runs in P2P handshake mode (no metadata server): a session is ``host:rpc_port``, and
the pool tensor is registered with it once. Its listening sockets bind every interface whatever
``kv_ip`` says (Mooncake's behaviour): keep the port behind the cluster's firewall.
"""

import logging
from dataclasses import dataclass
from typing import Any

import torch

from xinserve.engines.core.sequence import Sequence
from xinserve.engines.kv.block_layout import BlockLayout
from xinserve.engines.kv.connector import KVConnectorBase
from xinserve.engines.kv.side_channel import HeldTransfers, SideChannelServer, TransferFailed, ask
from xinserve.engines.kv.transfer_config import KVTransferConfig
from xinserve.engines.platforms import transfer_engine_hint

logger = logging.getLogger(__name__)

# The params a decode instance needs, as the producer sends them (vLLM's NIXL connector's names).
REMOTE_FIELDS = {"remote_engine_id": str, "remote_block_ids": list, "remote_host": str, "remote_port": int,
                 "remote_request_id": str}


def transfer_engine(device_kind: str, host: str, protocol: str, device_name: str) -> Any:
    """Mooncake's ``TransferEngine`` in P2P handshake mode; refused clearly when the package is missing."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise RuntimeError(f"the MooncakeConnector needs Mooncake's transfer engine ({exc}); "
                           f"{transfer_engine_hint(device_kind)}") from None
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
    if rc != 0:
        raise RuntimeError(f"Mooncake's transfer engine failed to start on {host} over {protocol} (rc {rc})")
    return engine


@dataclass(slots=True)
class _Load:
    """One request's read: remote blocks ``first_remote`` onwards into ``local_block_ids``."""

    request_id: str
    params: dict[str, Any]
    local_block_ids: list[int]
    first_remote: int


class MooncakeConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, model: Any, block_size: int, data_parallel_rank: int) -> None:
        self.config = config
        self.load_failure_policy = config.kv_load_failure_policy
        self.model = model
        self.block_size = block_size
        self.port = config.kv_port + data_parallel_rank
        self.held = HeldTransfers(config.extra("hold_timeout_s")) if config.is_producer else None
        self.server: SideChannelServer | None = None
        self.engine: Any = None
        self._loads: list[_Load] = []
        self._consumed: set[str] = set()  # requests whose remote KV was claimed (once: a preempted one recomputes)
        self._load_errors: set[int] = set()
        self.loaded_blocks_total = 0
        self.load_failures_total = 0

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        if self.config.kv_buffer_device not in (None, kv_cache.device.type):
            raise ValueError(f"kv_buffer_device {self.config.kv_buffer_device} is not this engine's device "
                             f"({kv_cache.device.type}): blocks are read from the engine's own KV pool")
        super().register_kv_caches(kv_cache)
        self.layout = BlockLayout.of(self.model, kv_cache, self.block_size)
        config = self.config
        self.engine = transfer_engine(kv_cache.device.type, config.kv_ip, config.extra("protocol"),
                                      config.extra("device_name"))
        self.session = f"{config.kv_ip}:{self.engine.get_rpc_port()}"
        rc = self.engine.register_memory(kv_cache.data_ptr(), kv_cache.nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake refused to register the KV pool ({kv_cache.nbytes} bytes, rc {rc})")
        if self.held is not None:
            self.server = SideChannelServer(f"tcp://{config.kv_ip}:{self.port}", self._answer)
        logger.info("MooncakeConnector %s (%s): session %s, side channel %s:%d", config.engine_id, config.kv_role,
                    self.session, config.kv_ip, self.port)

    # scheduler side

    def check_request(self, params: dict[str, Any]) -> None:
        if params.get("do_remote_decode") and not self.config.is_producer:
            raise ValueError("kv_transfer_params.do_remote_decode: this instance is a kv_consumer")
        room = params.get("bootstrap_room")
        if room is not None and (not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2**64):
            raise ValueError(f"bootstrap_room must be an integer in [0, 2**64), got {room!r}")
        if not params.get("do_remote_prefill"):
            return
        if not self.config.is_consumer:
            raise ValueError("kv_transfer_params.do_remote_prefill: this instance is a kv_producer")
        for name, kind in REMOTE_FIELDS.items():
            value = params.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params.{name} must be a {kind.__name__}, got {value!r}")  # noqa: TRY004  a config value, a 400
        if not 0 < params["remote_port"] < 65536:
            raise ValueError(f"kv_transfer_params.remote_port must be a TCP port, got {params['remote_port']}")
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in params["remote_block_ids"]):
            raise ValueError("kv_transfer_params.remote_block_ids must be block ids (non-negative integers)")

    def get_num_new_matched_tokens(self, seq: Sequence, computed: list[int]) -> int:
        params = seq.params.kv_transfer_params
        if (not params or not params.get("do_remote_prefill") or not self.config.is_consumer
                or seq.request_id in self._consumed or seq.num_output_tokens or seq.parent is not None):
            return 0
        return max(0, seq.num_prompt_tokens - 1 - len(computed) * self.block_size)

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        self._consumed.add(seq.request_id)
        num_blocks = -(-num_external_tokens // self.block_size)
        first_remote = (seq.num_computed_tokens - num_external_tokens) // self.block_size
        self._loads.append(_Load(seq.request_id, seq.params.kv_transfer_params, block_ids[:num_blocks], first_remote))

    def build_connector_meta(self) -> list[_Load]:
        loads, self._loads = self._loads, []
        return loads

    def request_finished(self, seq: Sequence, reason: str) -> tuple[bool, dict[str, Any] | None]:
        self._consumed.discard(seq.request_id)
        params = seq.params.kv_transfer_params
        if self.held is None or not params or not params.get("do_remote_decode"):
            return False, None
        room = params.get("bootstrap_room")
        # As vLLM: only a prefill that ran to its max_tokens hands its KV over (an EOS first token ends it there).
        if reason != "length":
            if room is not None:
                self.held.hand_nothing(room)
            return False, None
        block_ids = list(seq.block_table)
        answer = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.config.engine_id,
            "remote_block_ids": block_ids, "remote_host": self.config.kv_ip, "remote_port": self.port,
            "remote_request_id": seq.request_id, "tp_size": 1,
        }
        self.held.hold(seq.request_id, block_ids, answer, room)
        return True, answer

    def finished_sending(self) -> set[str]:
        return set() if self.held is None else self.held.finished()

    # worker side

    def start_load_kv(self, meta: list[_Load]) -> None:
        self._load_errors = set()
        for load in meta:
            try:
                self._read(load)
            except TransferFailed as exc:
                logger.warning("request %s: reading its KV from the prefill instance failed: %s", load.request_id, exc)
                self._load_errors.update(load.local_block_ids)
                self.load_failures_total += 1
            else:
                self.loaded_blocks_total += len(load.local_block_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._load_errors

    def _read(self, load: _Load) -> None:
        params = load.params
        address = f"tcp://{params['remote_host']}:{params['remote_port']}"
        timeout_s = self.config.extra("handshake_timeout_s")
        reply = ask(address, {"op": "acquire", "request_id": params["remote_request_id"]}, timeout_s)
        if not reply.get("ok"):
            raise TransferFailed(str(reply.get("error")))
        if reply["engine_id"] != params["remote_engine_id"]:
            raise TransferFailed(f"{address} is engine {reply['engine_id']}, not {params['remote_engine_id']}")
        remote = BlockLayout(0, reply["block_size"], tuple(reply["offsets"]), tuple(reply["block_bytes"]))
        if not self.layout.same_shape(remote):
            raise TransferFailed("the prefill instance's KV blocks are laid out differently (model, block size "
                                 "or KV dtype)")
        held = reply["block_ids"]
        if list(params["remote_block_ids"]) != held:
            raise TransferFailed(f"remote_block_ids {params['remote_block_ids']} are not the blocks the prefill "
                                 f"instance holds for request {params['remote_request_id']}")
        remote_ids = held[load.first_remote : load.first_remote + len(load.local_block_ids)]
        if len(remote_ids) < len(load.local_block_ids):
            raise TransferFailed(f"the prefill instance holds {len(held)} blocks, fewer than the prompt needs")
        ptrs = self.layout.ranges(self.kv_cache.data_ptr(), load.local_block_ids, reply["base"], remote_ids,
                                  remote.offsets)
        rc = self.engine.batch_transfer_sync_read(reply["session"], *ptrs)
        if rc < 0:
            raise TransferFailed(f"Mooncake's read from {reply['session']} failed (rc {rc})")
        try:
            ask(address, {"op": "release", "request_id": params["remote_request_id"]}, timeout_s)
        except TransferFailed as exc:  # the read is done; the producer's hold then expires on its own
            logger.warning("request %s: %s", load.request_id, exc)

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """The side channel's answers (its own thread; engines/kv/side_channel.py)."""
        assert self.held is not None
        if request.get("op") == "lookup":
            return self.held.lookup(request.get("room"))
        request_id = str(request.get("request_id"))
        if request.get("op") == "release":
            return {"ok": self.held.release(request_id)}
        if request.get("op") != "acquire":
            return {"ok": False, "error": f"unknown op {request.get('op')!r}"}
        block_ids = self.held.acquire(request_id)
        if block_ids is None:
            return {"ok": False, "error": f"no KV blocks are held for request {request_id} "
                                          "(never held, already read, or the hold expired)"}
        layout = self.layout
        return {"ok": True, "engine_id": self.config.engine_id, "session": self.session,
                "base": self.kv_cache.data_ptr(), "block_size": layout.block_size, "offsets": list(layout.offsets),
                "block_bytes": list(layout.block_bytes), "block_ids": block_ids}

    # both

    def transfer_counters(self) -> dict[str, int]:
        held = self.held
        return {"kv_transfer_held_requests": 0 if held is None else held.num_held,
                "kv_transfer_sent_total": 0 if held is None else held.sent_total,
                "kv_transfer_expired_total": 0 if held is None else held.expired_total,
                "kv_transfer_failed_loads_total": self.load_failures_total}

    def report(self) -> dict[str, Any]:
        counters = self.transfer_counters()
        return {"kind": "MooncakeConnector", "kv_role": self.config.kv_role, "engine_id": self.config.engine_id,
                "side_channel": f"{self.config.kv_ip}:{self.port}", "session": self.session,
                "kv_load_failure_policy": self.load_failure_policy,
                "handshake_timeout_s": self.config.extra("handshake_timeout_s"),
                "bootstrap_timeout_s": self.config.extra("bootstrap_timeout_s"),
                "held_requests": counters["kv_transfer_held_requests"],
                "sent_requests": counters["kv_transfer_sent_total"],
                "expired_requests": counters["kv_transfer_expired_total"],
                "failed_loads": counters["kv_transfer_failed_loads_total"]}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.engine is not None and getattr(self, "kv_cache", None) is not None:
            self.engine.unregister_memory(self.kv_cache.data_ptr())
            self.engine = None


def make_remote_connector(config: dict[str, Any] | None, runner: Any, block_size: int,
                          data_parallel_rank: int) -> MooncakeConnector | None:
    """The engine's connector to other instances (None without ``kv_transfer_config``)."""
    if config is None:
        return None
    return MooncakeConnector(KVTransferConfig.parse(config), runner.model, block_size, data_parallel_rank)
