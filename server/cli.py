"""The ``xinserve`` command: ``serve``, ``bench`` and ``doctor``.

``xinserve serve`` with no arguments serves the embedded tiny model from ``config/default.yaml``;
``--config FILE`` serves a YAML config; ``--model PATH --device SPEC`` serves one model from flags.
Engine flags (``--max-model-len``, ...) given next to a config apply to every model in it.
"""

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from engines.config import COMPILE_ENV_VAR, COMPILE_MODES
from server.config import AppConfig, ConfigError, default_config_path, load_config, parse_config
from server.tool_calls import PARSERS

# Flag -> per-model config key; None (not given) leaves the config's value alone.
ENGINE_FLAGS = {
    "dtype": "dtype",
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "block_size": "block_size",
    "num_kv_blocks": "num_kv_blocks",
    "kv_cache_memory_fraction": "kv_cache_memory_fraction",
    "enable_prefix_caching": "enable_prefix_caching",
    "max_waiting_requests": "max_waiting_requests",
    "cpu_threads": "cpu_threads",
    "seed": "seed",
    "tensor_parallel_size": "tensor_parallel_size",
    "enforce_eager": "enforce_eager",
    "tool_call_parser": "tool_call_parser",
    "reasoning_parser": "reasoning_parser",
}
# Flag -> distributed config key (tensor-parallel groups over several machines)
DISTRIBUTED_FLAGS = ("nnodes", "node_rank", "master_addr", "master_port")
EMBEDDED_DEFAULT = {"models": [{"name": "xinserve-tiny", "path": "embedded:xinserve-tiny", "workers": ["cpu"]}]}


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (examples in config/, keys in the README)")
    p.add_argument("--model", help="Hugging Face model directory, or embedded:<name>")
    p.add_argument("--device", action="append",
                   help="worker device: cpu, cuda:N, npu:N, musa:N; repeat or comma-separate for several")
    p.add_argument("--served-model-name", help="the name clients send as 'model' (default: directory name)")
    p.add_argument("--tokenizer", help="tokenizer directory if not the model's")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", action="append", help="accepted API key (repeatable; also XINSERVE_API_KEY)")
    p.add_argument("--request-timeout", type=float, help="seconds before a request is aborted")
    p.add_argument("--trust-request-chat-template", action="store_const", const=True, default=None,
                   help="let requests replace the chat template (chat_template_kwargs.chat_template)")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-kv-blocks", type=int)
    p.add_argument("--kv-cache-memory-fraction", type=float)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--max-waiting-requests", type=int, help="queued requests per worker before 429")
    p.add_argument("--cpu-threads", type=int, help="torch threads per CPU worker (default: cores - 1)")
    p.add_argument("--seed", type=int)
    p.add_argument("--tensor-parallel-size", type=int,
                   help="ranks per replica; groups consecutive --device entries (--device cpu: N CPU ranks)")
    p.add_argument("--nnodes", type=int, help="machines the tensor-parallel groups span (README: multi-node)")
    p.add_argument("--node-rank", type=int, help="this machine's index; 0 serves HTTP, the others only run ranks")
    p.add_argument("--master-addr", help="node 0's address, reachable from every node")
    p.add_argument("--master-port", type=int, help="first rendezvous port on node 0 (one per group from it)")
    p.add_argument("--enforce-eager", action="store_const", const=True, default=None,
                   help="never compile or graph-capture decode steps (the model's compile: off)")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS),
                   help="how tool calls are read with tool_choice auto (default: detected from the chat template)")
    p.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3", "glm45"],
                   help="split <think> reasoning from the answer as reasoning_content (README: Reasoning)")
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
        if args.tokenizer:
            data["models"][0]["tokenizer"] = args.tokenizer
    else:
        if args.device or args.served_model_name or args.tokenizer:
            raise ConfigError("--device, --served-model-name and --tokenizer need --model")
        if args.config:
            data = load_config(args.config).model_dump()
        else:
            path = default_config_path()
            data = load_config(path).model_dump() if path.is_file() else EMBEDDED_DEFAULT
    data.setdefault("server", {})
    for model in data["models"]:
        for flag, key in ENGINE_FLAGS.items():
            value = getattr(args, flag, None)
            if value is not None:
                model[key] = value
    distributed = data.setdefault("distributed", {}) or {}
    data["distributed"] = distributed
    for flag in DISTRIBUTED_FLAGS:
        value = getattr(args, flag, None)
        if value is not None:
            distributed[flag] = value
    server = data["server"]
    if args.host is not None:
        server["host"] = args.host
    if args.port is not None:
        server["port"] = args.port
    if args.request_timeout is not None:
        server["request_timeout_s"] = args.request_timeout
    if args.trust_request_chat_template:
        server["trust_request_chat_template"] = True
    keys = list(server.get("api_keys") or []) + list(args.api_key or [])
    if env.get("XINSERVE_API_KEY"):
        keys.append(env["XINSERVE_API_KEY"])
    server["api_keys"] = keys
    compile_mode = env.get(COMPILE_ENV_VAR)
    if compile_mode is not None and compile_mode.strip().lower() not in COMPILE_MODES:
        # read by every worker's engine: refuse it here, not after each worker has loaded its model
        raise ConfigError(f"{COMPILE_ENV_VAR} must be one of {', '.join(COMPILE_MODES)}, got {compile_mode!r}")
    return parse_config(data, args.config or "(flags)")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server.app import create_app
    from server.graceful import GracefulServer

    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
    except ConfigError as exc:
        print(f"xinserve: {exc}", file=sys.stderr)
        return 2
    if config.distributed.node_rank > 0:
        from server.node import run_node

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
    from server import bench, doctor

    bench.add_args(sub.add_parser("bench", help="load-test any OpenAI-compatible server"))
    doctor.add_args(sub.add_parser("doctor", help="which devices and kernels this machine offers"))
    args = parser.parse_args(argv)
    if args.command is None:
        # Bare "xinserve" behaves like "xinserve serve": the README's first command.
        args = parser.parse_args(["serve"])
    if args.command == "serve":
        return serve(args)
    if args.command == "bench":
        return bench.run(args)
    return doctor.run(args)


if __name__ == "__main__":
    sys.exit(main())
