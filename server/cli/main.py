"""The ``xinserve`` command: ``serve``, ``warmup``, ``bench``, ``doctor`` and ``plan``.

``xinserve serve`` with no arguments serves the embedded tiny model from ``config/default.yaml``;
``--config FILE`` serves a YAML config; ``--model PATH --device SPEC`` serves one model from flags.
Engine flags (``--max-model-len``, ...) given next to a config apply to every model in it.
"""

import argparse
import copy
import logging
import os
import sys
from pathlib import Path
from typing import Any

from xinserve.engines.config import COMPILE_ENV_VAR, COMPILE_MODES
from xinserve.engines.worker.process_exit import leave_quickly
from xinserve.server.cli.bad_input import BadInput
from xinserve.server.cli.setting_flags import add_flags, apply_flags, flag_fields
from xinserve.server.config import (
    AppConfig,
    ConfigError,
    DistributedSettings,
    MetricsSettings,
    ServerSettings,
    default_config_path,
    parse_config,
    read_config_data,
)
from xinserve.server.lora.modules import LoraModule, for_model
from xinserve.server.model_settings import ModelSettings

# Model settings that are also flags (those with help text): given next to a config, each applies to
# every model in it.
MODEL_FLAGS = tuple(flag_fields(ModelSettings))
# Config section -> its settings; a field with help text is also a flag (server/cli/setting_flags.py).
SECTION_FLAGS = {"server": ServerSettings, "distributed": DistributedSettings, "metrics": MetricsSettings}
EMBEDDED_DEFAULT = {"models": [{"name": "xinserve-tiny", "path": "embedded:xinserve-tiny", "workers": ["cpu"]}]}


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    # Flags that pick the config, rather than set one of its keys.
    p.add_argument("--config", help="YAML config file (examples in config/, keys in docs/configuration.md)")
    p.add_argument("--model", help="Hugging Face model directory, or embedded:<name>")
    p.add_argument("--device", action="append",
                   help="worker device: cpu, cuda:N, npu:N, musa:N; repeat or comma-separate for several")
    p.add_argument("--served-model-name", help="the name clients send as 'model' (default: directory name)")
    for settings in (ServerSettings, ModelSettings, DistributedSettings, MetricsSettings):
        add_flags(p, settings)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_config(args: argparse.Namespace, env: dict[str, str] | None = None) -> AppConfig:
    """The config that ``serve`` runs: file or flags or the embedded default, then flag overrides."""
    env = os.environ if env is None else env
    if args.model and args.config:
        raise ConfigError("give either --config or --model, not both")
    if args.model:
        devices = [d for spec in (args.device or ["cpu"]) for d in spec.split(",") if d]
        name = args.served_model_name or Path(args.model.removeprefix("embedded:")).name or args.model
        data: dict[str, Any] = {"models": [{"name": name, "path": args.model, "workers": devices}]}
    else:
        if args.device or args.served_model_name or args.tokenizer:
            raise ConfigError("--device, --served-model-name and --tokenizer need --model")
        path = args.config or default_config_path()
        # validated once, after the flags: a file that lists one device per node is right only with --nnodes
        data = read_config_data(path) if args.config or path.is_file() else copy.deepcopy(EMBEDDED_DEFAULT)
    for model in data.get("models") or []:
        if isinstance(model, dict):  # anything else is reported by the validation below
            apply_flags(args, ModelSettings, model)
    _apply_lora_modules(getattr(args, "lora_modules", None) or [], data.get("models") or [])
    for name, settings in SECTION_FLAGS.items():
        if isinstance(data.get(name) or {}, dict):
            data[name] = data.get(name) or {}
            apply_flags(args, settings, data[name])
    if env.get("XINSERVE_API_KEY") and isinstance(data["server"], dict):  # after the file's and --api-key's keys
        data["server"]["api_keys"] = [*(data["server"].get("api_keys") or []), env["XINSERVE_API_KEY"]]
    compile_mode = env.get(COMPILE_ENV_VAR)
    if compile_mode is not None and compile_mode.strip().lower() not in COMPILE_MODES:
        # read by every worker's engine: refuse it here, not after each worker has loaded its model
        raise ConfigError(f"{COMPILE_ENV_VAR} must be one of {', '.join(COMPILE_MODES)}, got {compile_mode!r}")
    return parse_config(data, str(args.config or "(flags)"))


def _apply_lora_modules(modules: list[LoraModule], models: list[Any]) -> None:
    """``--lora-modules``' adapters added to each model's ``lora_modules`` (those of its base_model_name
    only to that model)."""
    entries = [m for m in models if isinstance(m, dict)]
    served = [str(m.get("name")) for m in entries]
    for model in entries:
        try:
            adapters = for_model(modules, str(model.get("name")), served)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if adapters:
            model["lora_modules"] = {**(model.get("lora_modules") or {}), **adapters}


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from xinserve.server.app import create_app
    from xinserve.server.http.graceful import GracefulServer

    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = build_config(args)
    if config.distributed.node_rank > 0:
        from xinserve.server.worker.node import run_node

        return run_node(config, level)
    names = ", ".join(f"{m.name} on {', '.join('+'.join(g) for g in m.groups)}" for m in config.models)
    logging.getLogger("xinserve.server").info(
        "serving %s at http://%s:%d/v1 (auth %s)", names, config.server.host, config.server.port,
        "on" if config.server.api_keys else "off",
    )
    app = create_app(config, level)
    # Drained requests are done before uvicorn stops; its own grace only bounds a hung connection.
    uvicorn_config = uvicorn.Config(app, host=config.server.host, port=config.server.port,
                                    log_level=args.log_level, access_log=False, timeout_graceful_shutdown=5)
    server = GracefulServer(uvicorn_config, app.state.drain, config.server.shutdown_timeout_s)

    def stop(report: str) -> None:
        app.state.fatal_error = report
        server.should_exit = True

    app.state.stop = stop
    server.run()
    if app.state.fatal_error:
        print(f"xinserve: {app.state.fatal_error}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xinserve", description="OpenAI-compatible LLM inference server")
    sub = parser.add_subparsers(dest="command")
    _add_serve_args(sub.add_parser("serve", help="run the server (no arguments: the embedded tiny model)"))
    _add_serve_args(sub.add_parser("warmup", help="fill the caches the server's CPU workers start from, then exit "
                                                  "(takes serve's flags)"))
    from xinserve.server.cli import bench, doctor, plan, warmup

    bench.add_args(sub.add_parser("bench", help="load-test any OpenAI-compatible server"))
    doctor.add_args(sub.add_parser("doctor", help="which devices and kernels this machine offers"))
    plan.add_args(sub.add_parser("plan", help="whether a model fits N cards, from its config.json alone"))
    args = parser.parse_args(argv)
    if args.command is None:
        # Bare "xinserve" behaves like "xinserve serve": the README's first command.
        args = parser.parse_args(["serve"])
    commands = {"serve": serve, "warmup": lambda a: warmup.run(build_config(a), a.log_level), "bench": bench.run,
                "plan": plan.run, "doctor": doctor.run}
    try:
        return commands[args.command](args)
    except BadInput as exc:  # a file, path or field the user gave: one line naming it, as argparse's own errors
        print(f"xinserve {args.command}: {exc}", file=sys.stderr)
        return 2


def run() -> None:
    """The ``xinserve`` command (pyproject.toml's entry point): ``main``, then a quick exit."""
    code = main()
    leave_quickly()
    sys.exit(code)


if __name__ == "__main__":
    run()
