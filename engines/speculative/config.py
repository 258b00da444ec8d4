"""``speculative_config`` as vLLM spells it: a mapping (JSON on the command line, a YAML mapping per
model, a dict for ``LLM``), parsed once into a ``SpeculativeConfig``. No torch.

Methods: ``ngram`` (prompt lookup, no extra model) and ``mtp`` (the checkpoint's own multi-token-prediction
layer, engines/models/mtp.py; vLLM's aliases ``deepseek_mtp`` and ``glm4_moe_mtp`` read as ``mtp``). A
separate draft model (``"model": PATH``) and EAGLE heads are named here so that a config asking for them is
refused clearly until they are built.
"""

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "mtp")
ALIASES = {"deepseek_mtp": "mtp", "glm4_moe_mtp": "mtp"}  # vLLM's per-architecture names of the same method
PLANNED = {"draft_model": "a separate draft model", "eagle": "EAGLE heads", "eagle3": "EAGLE-3 heads"}
# Past this many running sequences a step is compute-bound and verification costs more than the drafts
# save; measured on CPU by benchmarks/speculative.py (docs/speculative-decoding.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # Stop drafting while more sequences than this are running (vLLM's ``disable_by_batch_size``).
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE


_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
         "model"}


def parse_speculative_config(value: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
    """The checked config; raises ValueError naming the key at fault."""
    if isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        # ValueError, not TypeError: pydantic reports it as the YAML key's validation error
        raise ValueError(f"speculative_config must be a mapping, got {type(value).__name__}")  # noqa: TRY004
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
    method = value.get("method")
    if method is None and value.get("model") is not None:
        method = "draft_model"  # vLLM's reading of a config that names only a model
    method = ALIASES.get(method, method)
    if method in PLANNED:
        raise ValueError(f"speculative_config: method {method!r} ({PLANNED[method]}) is not supported yet; "
                         f"supported: {', '.join(METHODS)}")
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
    if value.get("model") is not None:
        raise ValueError(f"speculative_config: method {method!r} takes no model")
    if method == "mtp" and ({"prompt_lookup_min", "prompt_lookup_max"} & set(value)):
        raise ValueError("speculative_config: prompt_lookup_min / prompt_lookup_max are the ngram method's; "
                         "method 'mtp' drafts with the checkpoint's MTP layer")
    k = _int(value, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    low = _int(value, "prompt_lookup_min", None, 1, None)
    high = _int(value, "prompt_lookup_max", None, 1, None)
    # vLLM: either bound alone sets both
    low, high = low or high or 1, high or low or 4
    if low > high:
        raise ValueError(f"speculative_config: prompt_lookup_min {low} is more than prompt_lookup_max {high}")
    disable = _int(value, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, 1, None)
    return SpeculativeConfig(method, k, low, high, disable)


def uses_mtp(value: dict[str, Any] | SpeculativeConfig | None) -> bool:
    """Whether an engine's ``speculative_config`` asks for the checkpoint's MTP layer."""
    return value is not None and parse_speculative_config(value).method == "mtp"


def _int(value: dict[str, Any], key: str, default: int | None, low: int, high: int | None) -> int | None:
    got = value.get(key, default)
    if got is None:
        if key == "num_speculative_tokens":
            raise ValueError("speculative_config: num_speculative_tokens is required")
        return None
    if isinstance(got, bool) or not isinstance(got, int):
        raise ValueError(f"speculative_config: {key} must be an integer, got {got!r}")  # noqa: TRY004
    if got < low or (high is not None and got > high):
        bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
        raise ValueError(f"speculative_config: {key} must be {bound}, got {got}")
    return got
