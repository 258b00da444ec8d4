"""The KV connector seam: how KV blocks move between the engine's device pool and something outside it
(a host tier, another instance's pool), shaped like vLLM's ``KVConnectorBase_V1``.

vLLM runs the two halves in two processes (``KVConnectorRole.SCHEDULER`` / ``WORKER``); here the engine,
its scheduler and its runner share one process, so one object plays both roles and the engine calls
each half at its point of the step (engines/core/engine.py, engines/core/scheduler.py):

scheduler side
- ``get_num_new_matched_tokens(seq, computed)``: while a prompt is admitted, how many tokens past the
  pool's own hits (``computed``: their block ids) this connector will load instead of them being
  computed;
- ``update_state_after_alloc(seq, block_ids, num_external_tokens)``: the pool blocks allocated for the
  sequence past its own hits, the first of which receive those tokens;
- ``build_connector_meta()``: the step's transfers, once the step is scheduled;
- ``request_finished(seq, reason)``: a sequence ends; ``(hold, kv_transfer_params)``: whether the
  scheduler must keep its blocks (another instance will read them) and what the client gets back;
- ``finished_sending()``: request ids whose held blocks may be freed now (read, or expired).

worker side
- ``register_kv_caches(kv_cache)``: the pool tensor, once allocated;
- ``start_load_kv(meta)``: run the step's transfers; loads complete before it returns, so the forward
  that follows reads them (no per-layer wait: these connectors move whole blocks, as they lie in the
  pool, before the forward);
- ``get_block_ids_with_load_errors()``: pool blocks that ``start_load_kv`` failed to fill; the engine
  recomputes or fails their requests (``kv_load_failure_policy``).

``host_tier.HostKVConnector`` keeps evicted prefix blocks in host memory; ``mooncake_connector`` hands a
prefill instance's blocks to a decode instance (prefill/decode disaggregation).
"""

from abc import ABC, abstractmethod
from typing import Any

from xinserve.engines.core.outputs import FinishReason
from xinserve.engines.core.sequence import Sequence


class KVConnectorBase(ABC):
    # What the engine does with a request whose blocks a load failed to fill: "recompute" them, or "fail" it.
    load_failure_policy = "recompute"

    # scheduler side

    def check_request(self, kv_transfer_params: dict[str, Any]) -> None:
        """Raise ValueError (a 400) when a request's ``kv_transfer_params`` cannot be served here."""
        raise ValueError(f"{type(self).__name__} takes no kv_transfer_params")

    def bind_block_manager(self, block_manager: Any) -> None:
        """The engine's block manager (engines/core/kv_cache.py), for connectors keyed by its block hashes."""
        self.block_manager = block_manager

    @abstractmethod
    def get_num_new_matched_tokens(self, seq: Sequence, computed: list[int]) -> int:
        """Tokens after the ``computed`` pool blocks this connector will load for ``seq`` (0: none). At
        least one prompt token is always left to compute, so that its logits exist."""

    @abstractmethod
    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        """``block_ids``: the blocks allocated to ``seq`` after its pool hits; the first
        ``num_external_tokens`` tokens they hold are this connector's to fill."""

    @abstractmethod
    def build_connector_meta(self) -> Any:
        """The transfers of the step just scheduled, handed to ``start_load_kv``."""

    def request_finished(self, seq: Sequence, reason: FinishReason) -> tuple[bool, dict[str, Any] | None]:
        """``seq`` ended: whether its blocks stay held for a reader, and the ``kv_transfer_params`` of its
        response. A connector that hands nothing to another instance holds nothing."""
        return False, None

    def finished_sending(self) -> set[str]:
        """Ids of requests whose held blocks were read (or whose hold expired): free them now."""
        return set()

    # worker side

    def register_kv_caches(self, kv_cache: Any) -> None:
        self.kv_cache = kv_cache

    @abstractmethod
    def start_load_kv(self, meta: Any) -> None:
        """Run ``meta``'s transfers into (and out of) the registered pool before the step's forward."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Pool blocks the last ``start_load_kv`` could not fill (none for a connector that cannot fail)."""
        return set()

    # both

    def clear(self) -> None:
        """The prefix cache was reset: nothing cached before may be served."""

    def transfer_counters(self) -> dict[str, int]:
        """``EngineStats``' kv_transfer_* fields (/metrics), for a connector to other instances."""
        return {}

    def report(self) -> dict[str, Any]:
        """What /health shows of this connector."""
        return {"kind": type(self).__name__}

    def close(self) -> None:
        """Release the connector's threads, sockets and registered memory."""
