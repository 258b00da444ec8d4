"""``kv_transfer_config`` (``--kv-transfer-config``): vLLM's ``KVTransferConfig`` fields, for prefill/decode
disaggregation (engines/kv/mooncake_connector.py; docs/disaggregation.md).

The fields are vLLM's, spelled as vLLM spells them; ``kv_rank``, ``kv_parallel_size``, ``kv_buffer_size``
and ``kv_connector_module_path`` are accepted for configs written for vLLM and not used (blocks are read
in place from the engine's own pool, which has no separate buffer). ``kv_connector_extra_config`` takes
this connector's own settings (``EXTRA_DEFAULTS``).
"""

import uuid
from dataclasses import dataclass, field, fields
from typing import Any

CONNECTORS = ("MooncakeConnector",)
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("recompute", "fail")
BUFFER_DEVICES = ("cpu", "cuda", "npu", "musa")
# kv_connector_extra_config: the transport (Mooncake's "tcp" or "rdma"), the RDMA device to use ("" lets
# Mooncake choose), how long a prefill instance holds a finished request's blocks for its reader (vLLM's
# VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s), how long a decode instance waits for the prefill
# instance's side channel to answer, and how long it waits for the prefill of an SGLang bootstrap_room
# to finish (SGLang's SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 s).
EXTRA_DEFAULTS: dict[str, Any] = {"protocol": "tcp", "device_name": "", "hold_timeout_s": 480.0,
                                  "handshake_timeout_s": 5.0, "bootstrap_timeout_s": 300.0}
PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_ip: str = "127.0.0.1"  # this instance's side channel; the host a decode instance reaches it at
    kv_port: int = 14579  # its side-channel port (plus the engine's data_parallel_rank)
    kv_buffer_device: str | None = None  # None: the engine's own device
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_buffer_size: float | None = None
    kv_connector_module_path: str | None = None

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str) -> Any:
        return self.kv_connector_extra_config.get(key, EXTRA_DEFAULTS[key])

    @classmethod
    def parse(cls, value: dict[str, Any]) -> "KVTransferConfig":
        """Checked as vLLM would check it; a ValueError names the field."""
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {type(value).__name__}")  # noqa: TRY004  a config value, a 400
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown field(s) {', '.join(unknown)}")
        for name, choices in (("kv_connector", CONNECTORS), ("kv_role", ROLES)):
            if value.get(name) not in choices:
                raise ValueError(f"kv_transfer_config.{name} must be one of {', '.join(choices)}, "
                                 f"got {value.get(name)!r}")
        if value.get("kv_load_failure_policy", "recompute") not in FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config.kv_load_failure_policy must be one of "
                             f"{', '.join(FAILURE_POLICIES)}, got {value['kv_load_failure_policy']!r}")
        device = value.get("kv_buffer_device")
        if device is not None and device not in BUFFER_DEVICES:
            raise ValueError(f"kv_transfer_config.kv_buffer_device must be one of {', '.join(BUFFER_DEVICES)}, "
                             f"got {device!r}")
        port = value.get("kv_port", 14579)
        if not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"kv_transfer_config.kv_port must be a port number, got {port!r}")
        for name in ("engine_id", "kv_ip"):
            if name in value and not (isinstance(value[name], str) and value[name]):
                raise ValueError(f"kv_transfer_config.{name} must be a non-empty string")
        _check_extra(value.get("kv_connector_extra_config", {}))
        return cls(**value)


def _check_extra(extra: Any) -> None:
    if not isinstance(extra, dict):
        raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object")  # noqa: TRY004  a config value, a 400
    unknown = sorted(set(extra) - set(EXTRA_DEFAULTS))
    if unknown:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key(s) {', '.join(unknown)} "
                         f"(known: {', '.join(EXTRA_DEFAULTS)})")
    if extra.get("protocol", "tcp") not in PROTOCOLS:
        raise ValueError(f"kv_connector_extra_config.protocol must be one of {', '.join(PROTOCOLS)}")
    for key in ("hold_timeout_s", "handshake_timeout_s", "bootstrap_timeout_s"):
        seconds = extra.get(key, EXTRA_DEFAULTS[key])
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= 86400:
            raise ValueError(f"kv_connector_extra_config.{key} must be a number of seconds in (0, 86400]")
    if not isinstance(extra.get("device_name", ""), str):
        raise ValueError("kv_connector_extra_config.device_name must be a string")  # noqa: TRY004  a config value, a 400


def parse_kv_transfer_config(value: dict[str, Any]) -> KVTransferConfig:
    return KVTransferConfig.parse(value)
