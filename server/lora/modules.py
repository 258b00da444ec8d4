"""``--lora-modules``: the adapters a model loads at start, as vLLM spells them, and their checks.

Each value is ``name=path`` or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}``;
several follow one flag (``--lora-modules a=/x b=/y``) or the flag repeats. The flag applies to every
model of a config, as the other engine flags do, except an adapter whose JSON names its
``base_model_name``: only that model loads it (``for_model``). The config file's key is a mapping
``lora_modules: {name: path}`` per model.

An adapter is a PEFT directory: ``adapter_config.json`` beside the weights. Its directory is checked
when the config is read, so a typo stops the start with the adapter's name instead of failing a worker
later; the engine checks the rest (rank, target modules, shapes) when it loads it.
"""

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True, slots=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str | None = None  # the one model that loads it; None: every model of the config


def parse_lora_module(text: str) -> LoraModule:
    """One ``--lora-modules`` value: ``name=path`` or vLLM's JSON object."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON in --lora-modules {text!r}: {exc}") from None
        unknown = sorted(set(value) - {"name", "path", "base_model_name"}) if isinstance(value, dict) else []
        if not isinstance(value, dict) or unknown or not all(
                isinstance(value.get(k), str) and value[k].strip() for k in ("name", "path")):
            raise argparse.ArgumentTypeError(
                f'--lora-modules expects {{"name": ..., "path": ..., "base_model_name": ...}} with a non-empty '
                f"name and path{f' (unknown key(s) {unknown})' if unknown else ''}, got {text!r}")
        base = value.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError(f"--lora-modules: base_model_name must be a string, got {base!r}")
        return LoraModule(value["name"].strip(), value["path"].strip(), base)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"--lora-modules expects name=path or a JSON object, got {text!r}")
    return LoraModule(name.strip(), path.strip())


class LoraModulesAction(argparse.Action):
    """``--lora-modules`` with one or more values, repeatable: a list of ``LoraModule`` in the order given."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.pop("type", None)
        super().__init__(option_strings, dest, nargs="+", metavar="NAME=PATH|JSON", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            modules = [parse_lora_module(v) for v in values]
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), *modules])


def for_model(modules: list[LoraModule], model: str, served: list[str]) -> dict[str, str]:
    """The flag's adapters that ``model`` loads, name -> path; ValueError for a ``base_model_name``
    that names no model in ``served``, or a name given twice."""
    out: dict[str, str] = {}
    for module in modules:
        if module.base_model_name is not None and module.base_model_name not in served:
            raise ValueError(f"--lora-modules: adapter {module.name!r} names base_model_name "
                             f"{module.base_model_name!r}, which is not a served model ({', '.join(served)})")
        if module.base_model_name in (None, model):
            if module.name in out:
                raise ValueError(f"--lora-modules: adapter {module.name!r} is given twice")
            out[module.name] = module.path
    return out


def adapter_dir_problem(path: str) -> str | None:
    """Why ``path`` is no PEFT adapter directory (None: it has an ``adapter_config.json``)."""
    full = os.path.expanduser(path)
    if not os.path.isdir(full):
        return f"directory {path} does not exist"
    if not os.path.isfile(os.path.join(full, ADAPTER_CONFIG)):
        return f"{path} has no {ADAPTER_CONFIG} (not a PEFT adapter directory)"
    return None


def check_adapters(models: list[Any]) -> None:
    """Start-up checks over every model's ``lora_modules`` (ModelSettings): each needs ``enable_lora``,
    a PEFT directory, and a name that is neither a served model's nor another adapter's (a request's
    ``model`` field names either, so each name must pick one)."""
    served = {m.name for m in models}
    owner: dict[str, str] = {}
    for i, model in enumerate(models):
        for name, path in (model.lora_modules or {}).items():
            where = f"models.{i}.lora_modules.{name}"
            if not model.enable_lora:
                raise ValueError(f"{where}: LoRA adapters need enable_lora (--enable-lora) on model {model.name}")
            if name in served:
                raise ValueError(f"{where}: the adapter's name is a served model's name; give it another")
            if name in owner:
                raise ValueError(f"{where}: adapter name {name!r} is also an adapter of model {owner[name]}")
            problem = adapter_dir_problem(path)
            if problem:
                raise ValueError(f"{where}: {problem}")
            owner[name] = model.name
