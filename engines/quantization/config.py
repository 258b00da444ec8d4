"""What a checkpoint's config.json says about its quantization (``quantization_config``)."""

from typing import Any


def quant_method(config: Any) -> str | None:
    """``quantization_config.quant_method`` (a dict or an object in the config), None when absent."""
    settings = getattr(config, "quantization_config", None)
    if settings is None:
        return None
    method = settings.get("quant_method") if isinstance(settings, dict) else getattr(settings, "quant_method", None)
    return str(getattr(method, "value", method)) if method is not None else "unknown"


def quant_config(config: Any) -> dict[str, Any]:
    """The config's ``quantization_config`` as a dict ({} when absent)."""
    value = getattr(config, "quantization_config", None) or {}
    return value if isinstance(value, dict) else value.to_dict()
