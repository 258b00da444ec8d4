"""The server's YAML configuration (examples in config/, keys in docs/configuration.md), validated by pydantic.

Every section forbids unknown keys, so a typo fails at start-up with the key's dotted path
(``models.0.wokers: Extra inputs are not permitted``) instead of being silently ignored.
"""

import os
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, SecretStr, Tag, model_validator
from pydantic_core import ValidationError

from xinserve.engines.platforms import ranks_share_the_device
from xinserve.server.cli.bad_input import BadInput, read_text
from xinserve.server.lora.modules import check_adapters
from xinserve.server.model_settings import ModelSettings


class ConfigError(BadInput):
    """A config file or flag combination that cannot be served; the message names the bad key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ApiKey(_Section):
    """A named API key: the key itself, or the environment variable that holds it (a Kubernetes Secret).

    ``models`` limits the key to those models; to it the others do not exist (404). Empty: every model.
    The name, never the key, labels the key's metrics and request log lines.
    """

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    key: SecretStr | None = None
    key_env: str | None = Field(None, min_length=1)
    models: list[str] = Field(default_factory=list)
    _secret: str = PrivateAttr("")

    @model_validator(mode="after")
    def _resolve(self) -> "ApiKey":
        if (self.key is None) == (self.key_env is None):
            raise ValueError(f"api key {self.name!r}: give exactly one of key and key_env")
        # Read when the config is loaded, so a missing variable stops start-up with the key's name.
        secret = self.key.get_secret_value() if self.key is not None else os.environ.get(self.key_env, "")
        if not secret:
            source = "key" if self.key is not None else f"environment variable {self.key_env}"
            raise ValueError(f"api key {self.name!r}: {source} is empty or unset")
        self._secret = secret
        return self

    @property
    def secret(self) -> str:
        return self._secret


# A plain string or a mapping; told apart before validation, so an error names one branch only.
KeyEntry = Annotated[
    Annotated[str, Tag("key")] | Annotated[ApiKey, Tag("named")],
    Discriminator(lambda v: "key" if isinstance(v, str) else "named"),
]


class ServerSettings(_Section):
    """The HTTP server. A field with a description is also a ``serve`` flag (server/cli/setting_flags.py)."""

    host: str = Field("0.0.0.0", description="address to listen on (default: 0.0.0.0, every interface)")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (default: 8000)")
    # Plain strings (also --api-key and XINSERVE_API_KEY, appended after the file's) are keys for every
    # model, named by their position in this list: "key-1", "key-2", ...
    api_keys: list[KeyEntry] = Field(default_factory=list, json_schema_extra={"flag": "api-key"},
                                     description="accepted API key (repeatable; also XINSERVE_API_KEY)")
    request_timeout_s: float = Field(600, gt=0, json_schema_extra={"flag": "request-timeout"},
                                     description="seconds before a request is aborted")
    # Paths reachable without a key even when api_keys is set (probes and Prometheus scrapers).
    auth_exempt_paths: list[str] = Field(default_factory=lambda: ["/health", "/metrics"])
    log_requests: bool = True
    # Whether a chat request may replace the model's chat template (``chat_template_kwargs.chat_template``,
    # vLLM's --trust-request-chat-template): a template is code that runs on the server; off by default.
    trust_request_chat_template: bool = Field(
        False, description="let requests replace the chat template (chat_template_kwargs.chat_template)")
    # After SIGTERM/SIGINT: seconds running requests get to finish (the rest then end with an
    # error), then seconds workers get to leave before they are killed.
    shutdown_timeout_s: float = Field(10, gt=0)
    # A ready worker silent this long is "unresponsive" (routed around, its requests moved or ended);
    # silent twice as long, it is killed and restarted (server/pool/heartbeat.py).
    heartbeat_timeout_s: float = Field(10, gt=0)

    @model_validator(mode="after")
    def _check_key_names(self) -> "ServerSettings":
        keys = self.named_keys()
        names = [k.name for k in keys]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"api_keys: duplicate key name(s) {dupes}")
        # One key, one name: the name is what metrics and logs attribute a request to.
        if len({k.secret for k in keys}) < len(keys):
            raise ValueError("api_keys: two entries have the same key")
        return self

    def named_keys(self) -> list[ApiKey]:
        """Every key as an ApiKey; plain strings named "key-<position>" (1-based)."""
        return [k if isinstance(k, ApiKey) else ApiKey(name=f"key-{i}", key=k)
                for i, k in enumerate(self.api_keys, start=1)]


class DistributedSettings(_Section):
    """Tensor-parallel groups over several machines (``--nnodes`` ...): every node runs the same
    config; node 0 serves HTTP and hosts each group's rendezvous at ``master_addr``, at
    ``master_port`` + the group's index over all models' groups in config order."""

    nnodes: int = Field(1, ge=1, description="machines the tensor-parallel groups span (docs/parallelism.md)")
    node_rank: int = Field(0, ge=0, description="this machine's index; 0 serves HTTP, the others only run ranks")
    master_addr: str = Field("127.0.0.1", description="node 0's address, reachable from every node")
    master_port: int = Field(0, ge=0, le=65535,  # 0: any free port (one node only)
                             description="first rendezvous port on node 0 (one per group from it)")
    rendezvous_timeout_s: float = Field(120, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "DistributedSettings":
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is not below nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("several nodes need an explicit master_port (--master-port)")
        return self


class MonitoringSettings(_Section):
    metrics: bool = True


class MetricsSettings(_Section):
    # The engine metrics' namespace: "vllm" names them as vLLM does (vllm:num_requests_waiting ...), so
    # routers, autoscalers and dashboards configured for vLLM read them unchanged.
    prefix: str = Field("xinserve", pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$", json_schema_extra={"flag": "metric-prefix"},
                        description="the engine metrics' prefix: xinserve (default), or vllm as vLLM's")


class LimitsSettings(_Section):
    """Per-request input limits, checked before a request costs any tokenising or engine time.

    OpenAI's own API limits (4 stop strings, ``top_logprobs`` <= 20, completions ``logprobs`` <= 5,
    300 ``logit_bias`` entries) are fixed in ``server/api/openai/protocol.py``; these are the operator's.
    """

    # Bytes of request body; larger bodies get a 413 before any of it is parsed.
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1)
    max_messages: int = Field(2048, ge=1)
    # Characters of prompt text per request (all messages with their tool calls' names and arguments,
    # or all string prompts; and the rendered chat prompt), before tokenising.
    max_prompt_chars: int = Field(1_000_000, ge=1)
    # Characters per stop string: the detokenizer's hold-back check costs O(length^2) per token
    # (measured 0.16 ms at 256 characters, 0.8 s at 100,000), and it runs in the HTTP process.
    max_stop_chars: int = Field(256, ge=1)
    max_n: int = Field(128, ge=1)
    # Inputs of one pooling request (embeddings, classify, score's and rerank's texts): OpenAI's limit on
    # an embeddings request's array (server/api/pooling/).
    max_pooling_inputs: int = Field(2048, ge=1)
    # Tokens one request may ask for; None: only the model's context length bounds it.
    max_tokens: int | None = Field(None, ge=1)


class ResponsesStoreSettings(_Section):
    """The Responses API's stored responses (``previous_response_id``, ``GET /v1/responses/{id}``): in
    memory, each API key with its own budget (requests without a key share one), so a key's entries
    are evicted only by its own traffic (``server/api/responses/store.py``)."""

    max_entries_per_key: int = Field(1000, ge=1)
    # An entry's bytes: its response and conversation as JSON. The HTTP process may hold this much
    # per configured key (and once for requests without a key).
    max_bytes_per_key: int = Field(64 * 1024 * 1024, ge=1)
    ttl_s: float = Field(3600, gt=0)


class AppConfig(_Section):
    server: ServerSettings = Field(default_factory=ServerSettings)
    models: list[ModelSettings] = Field(min_length=1)
    monitoring: MonitoringSettings = Field(default_factory=MonitoringSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    responses_store: ResponsesStoreSettings = Field(default_factory=ResponsesStoreSettings)
    distributed: DistributedSettings = Field(default_factory=DistributedSettings)

    @model_validator(mode="after")
    def _check_groups(self) -> "AppConfig":
        """Every tensor-parallel group fits the nodes, has one device kind, and no card twice."""
        from xinserve.engines.parallel.parallel_config import ParallelConfig

        nnodes = self.distributed.nnodes
        for model in self.models:
            used: set[tuple[int, str]] = set()
            for group in model.groups:
                if len(group) == 1:
                    continue  # a single-device worker runs on node 0 and may share its card (npu:0#1)
                parallel = ParallelConfig(devices=group, nnodes=nnodes, master_port=1)
                parallel.check(model.name)
                for node in range(nnodes):
                    cards = {group[r] for r in parallel.node_ranks(node) if not ranks_share_the_device(group[r])}
                    for device in cards:
                        if (node, device) in used:
                            raise ValueError(f"model {model.name}: device {device} is listed twice "
                                             f"(in two tensor-parallel groups)")
                        used.add((node, device))
        groups = sum(len(g) > 1 for m in self.models for g in m.groups)
        port = self.distributed.master_port
        if port and port + groups - 1 > 65535:
            raise ValueError(f"distributed.master_port {port}: the {groups} tensor-parallel groups rendezvous "
                             f"on ports {port}..{port + groups - 1}, past 65535")
        return self

    @model_validator(mode="after")
    def _check_names(self) -> "AppConfig":
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"models: duplicate model name(s) {dupes}")
        for i, model in enumerate(self.models):
            for target in model.fallback:
                if target == model.name:
                    raise ValueError(f"models.{i}.fallback: a model cannot fall back to itself")
                if target not in names:
                    raise ValueError(f"models.{i}.fallback: unknown model {target!r}")
        check_adapters(self.models)
        for key in self.server.named_keys():
            unknown = sorted(set(key.models) - set(names))
            if unknown:
                raise ValueError(f"server.api_keys: key {key.name!r} names unknown model(s) {unknown}")
        return self

    def model(self, name: str) -> ModelSettings | None:
        return next((m for m in self.models if m.name == name), None)


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "<config>") -> AppConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: the top level must be a mapping")
    try:
        return AppConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def read_config_data(path: str | Path) -> dict[str, Any]:
    """A YAML config file's mapping, not yet validated (``serve`` applies its flags first: ``--nnodes``
    decides whether a device may repeat); raises ConfigError for a missing file, bad YAML or a top level
    that is not a mapping."""
    path = Path(path)
    try:
        text = read_text(path, "config")
    except BadInput as exc:
        raise ConfigError(str(exc)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {path}: the top level must be a mapping")
    return data


def load_config(path: str | Path) -> AppConfig:
    """Read and validate a YAML file; raises ConfigError with every bad key named."""
    return parse_config(read_config_data(path), str(path))


def default_config_path() -> Path:
    """``config/default.yaml`` of the source tree (also shipped as package data)."""
    return Path(__file__).resolve().parent.parent / "config" / "default.yaml"
