"""A served model's settings: the engine's (generated from ``EngineConfig``) and the server's own."""

from typing import Literal

from pydantic import Field, field_validator, model_validator

from xinserve.engines.platforms import normal_device, ranks_share_the_device
from xinserve.server.engine_settings import EngineSettings

EMBEDDED_PREFIX = "embedded:"


class ModelSettings(EngineSettings):
    """One served model: every engine setting (``server/engine_settings.py``, from ``EngineConfig``) and
    the server's own keys. A field with a description is also a ``serve`` flag (server/cli/setting_flags.py)."""

    name: str = Field(min_length=1)
    # A Hugging Face directory, or "embedded:<name>" for the built-in tiny model.
    path: str
    # Each entry is one replica: a device, or a list of devices for a tensor-parallel group
    # ([npu:0, npu:1] is one replica over two cards); see ``groups``. With plain-device workers,
    # consecutive devices form groups of ``tensor_parallel_size``.
    workers: list[str | list[str]] = Field(default_factory=lambda: ["cpu"], min_length=1)
    fallback: list[str] = Field(default_factory=list)
    max_waiting_requests: int = Field(256, ge=0, description="queued requests per worker before 429")
    # None = the cores left after the HTTP process, shared between the CPU workers (so on 2 cores the
    # engine gets one and the HTTP loop the other).
    cpu_threads: int | None = Field(None, ge=1, description="torch threads per CPU worker (default: cores - 1)")
    # hermes also reads Qwen2.5 and Qwen3; glm47 also GLM-5.
    tool_call_parser: Literal["hermes", "llama3_json", "glm45", "glm47", "deepseek_v3"] | None = Field(
        None, description="how tool calls are read with tool_choice auto (default: detected from the chat template)")
    # server/api/reasoning/; None: the output is all content.
    reasoning_parser: Literal["deepseek_r1", "qwen3", "glm45"] | None = Field(
        None, description="split <think> reasoning from the answer as reasoning_content (docs/api.md: Reasoning)")

    @field_validator("workers")
    @classmethod
    def _check_workers(cls, value: list[str | list[str]]) -> list[str | list[str]]:
        out: list[str | list[str]] = []
        for entry in value:
            if isinstance(entry, list):
                if not entry:
                    raise ValueError("a tensor-parallel group of workers lists no device")
                out.append([normal_device(spec) for spec in entry])
            else:
                out.append(normal_device(entry))
        return out

    @model_validator(mode="after")
    def _check_groups(self) -> "ModelSettings":
        tp = self.ranks_per_replica
        sizes = (f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                 f"{self.pipeline_parallel_size}" if self.pipeline_parallel_size > 1 else f"tensor_parallel_size {tp}")
        listed = [w for w in self.workers if isinstance(w, list)]
        if listed and tp > 1 and any(len(g) != tp for g in listed):
            raise ValueError(f"model {self.name}: {sizes} but a group of workers lists "
                             f"a different number of devices")
        plain = [w for w in self.workers if isinstance(w, str)]
        if tp > 1 and plain and not _one_shared_device(plain) and len(plain) % tp:
            raise ValueError(f"model {self.name}: {len(plain)} worker devices do not form groups of {sizes}")
        return self

    @property
    def groups(self) -> list[list[str]]:
        """One device list per replica, in rank order: the listed groups, then the plain devices in
        groups of ``tensor_parallel_size`` x ``pipeline_parallel_size``."""
        tp = self.ranks_per_replica
        plain = [w for w in self.workers if isinstance(w, str)]
        if tp > 1 and _one_shared_device(plain):
            plain = plain * tp
        return [list(w) for w in self.workers if isinstance(w, list)] + [
            plain[i : i + tp] for i in range(0, len(plain), tp)
        ]

    @property
    def ranks_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def is_embedded(self) -> bool:
        return self.path.startswith(EMBEDDED_PREFIX)


def _one_shared_device(plain: list[str]) -> bool:
    """Whether the plain workers are one device that ranks share (``[cpu]``): with tensor parallel it
    stands for a whole group on it."""
    return len(plain) == 1 and ranks_share_the_device(plain[0])
