"""The engine settings of a served model, as YAML keys: generated from ``xinserve.engines.EngineConfig``'s fields.

Each field keeps the dataclass's type and default, its help text (the pydantic description, which
is also the ``serve`` flag's help) and its bounds or choices as pydantic constraints, so a bad value
fails at start-up with the key's dotted path (``models.0.max_num_seqs: Input should be greater than
or equal to 1``). ``xinserve.server.config.ModelSettings`` adds the server's own keys on top.
"""

from dataclasses import Field as DataclassField
from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model

from xinserve.engines.config import EngineConfig

# EngineConfig fields that are no model setting: ``path`` stands for the model, ``workers`` for the
# device, each tensor-parallel group of workers for the ranks' placement, and each worker's index for
# its replica's rank (server/pool/model_pool.py).
PLACED = ("model", "device", "parallel", "data_parallel_rank")
# Settings each worker receives resolved rather than as written: the tokenizer's local path, and its
# group's size (server/pool/model_pool.py).
PER_WORKER = ("tokenizer", "tensor_parallel_size")


class _EngineKeys(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``xinserve.engines.EngineConfig`` but those placed or resolved per worker."""
        return {name: getattr(self, name) for name in ENGINE_KEYS if name not in PER_WORKER}


def _pydantic_field(field: DataclassField) -> tuple[Any, Any]:
    meta = field.metadata
    annotation = field.type
    if "choices" in meta:
        annotation = Literal[meta["choices"]] | None if field.default is None else Literal[meta["choices"]]
    bounds = {key: meta[key] for key in ("ge", "gt", "le") if key in meta}
    if "check" in meta:  # a structured value: its parser's ValueError becomes the key's validation error
        annotation = Annotated[annotation, AfterValidator(_checked(meta["check"]))]
    return annotation, Field(field.default, description=meta["help"], **bounds)


def _checked(check: Any) -> Any:
    def validate(value: Any) -> Any:
        if value is not None:
            check(value)
        return value
    return validate


ENGINE_KEYS = tuple(f.name for f in fields(EngineConfig) if f.name not in PLACED)
EngineSettings = create_model(
    "EngineSettings", __base__=_EngineKeys,
    **{f.name: _pydantic_field(f) for f in fields(EngineConfig) if f.name in ENGINE_KEYS},
)
