"""``serve`` flags generated from the settings models, so a setting is defined once.

A field with a description is a flag: its help is the description, its type and choices the field's,
and its name the field's with dashes (``max_num_seqs`` -> ``--max-num-seqs``) unless the field names
another in ``json_schema_extra={"flag": ...}`` (``request_timeout_s`` -> ``--request-timeout``). Not
given, a flag is None and leaves the config as it is. A field in ``ACTIONS`` takes its own argparse
action, and its caller applies its values (``--lora-modules``: which model gets which adapter).
"""

import argparse
import json
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from xinserve.server.lora.modules import LoraModulesAction

# Fields whose flag is more than a typed value: field -> its argparse action; ``apply_flags`` leaves them.
ACTIONS: dict[str, type[argparse.Action]] = {"lora_modules": LoraModulesAction}


def flag_fields(settings: type[BaseModel]) -> dict[str, str]:
    """Flag (argparse ``dest``) -> field name, for every field of ``settings`` that is a flag."""
    out = {}
    for name, info in settings.model_fields.items():
        if info.description:
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            out[str(extra.get("flag", name)).replace("-", "_")] = name
    return out


def add_flags(p: argparse.ArgumentParser, settings: type[BaseModel]) -> None:
    """A flag per field of ``flag_fields(settings)``: a bool is ``--x/--no-x``, a list repeatable, a
    Literal a choice, a dict of strings ``op=impl,...``, another dict JSON (as vLLM takes them)."""
    for dest, name in flag_fields(settings).items():
        info = settings.model_fields[name]
        kind = _without_none(info.annotation)
        flag, options = "--" + dest.replace("_", "-"), {"help": info.description}
        if name in ACTIONS:
            p.add_argument(flag, action=ACTIONS[name], **options)
        elif kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, **options)
        elif get_origin(kind) is list:  # appended to the config's list (api_keys)
            p.add_argument(flag, action="append", **options)
        elif get_origin(kind) is Literal:
            p.add_argument(flag, choices=get_args(kind), **options)
        elif get_origin(kind) is dict and get_args(kind)[1] is str:
            p.add_argument(flag, type=_op_impl_pairs, metavar="OP=IMPL,...", **options)
        elif get_origin(kind) is dict:  # a structured setting (speculative_config)
            p.add_argument(flag, type=_json_object, metavar="JSON", **options)
        else:
            p.add_argument(flag, type=kind, **options)


def apply_flags(args: argparse.Namespace, settings: type[BaseModel], section: dict[str, Any]) -> None:
    """Write the flags given for ``settings`` into ``section`` (a config section's dict): a value
    replaces the section's, a list flag's values are appended to the section's list."""
    for dest, name in flag_fields(settings).items():
        value = getattr(args, dest)
        if name in ACTIONS:
            continue
        if isinstance(value, list):
            section[name] = [*(section.get(name) or []), *value]
        elif value is not None:
            section[name] = value


def _without_none(annotation: Any) -> Any:
    """``int | None`` -> ``int``; any other annotation (``list[str]``, a Literal) as it is."""
    if get_origin(annotation) in (Union, UnionType):
        return next(a for a in get_args(annotation) if a is not type(None))
    return annotation


def _op_impl_pairs(text: str) -> dict[str, str]:
    """``"op=impl,op=impl"`` -> {op: impl}; the names are checked by each worker's kernel registry."""
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    if not pairs or any(not sep or not op.strip() or not impl.strip() for op, sep, impl in pairs):
        raise argparse.ArgumentTypeError(f"expected op=impl[,op=impl...], got {text!r}")
    return {op.strip(): impl.strip() for op, _, impl in pairs}


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object flag value; its keys are checked with the rest of the config."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
