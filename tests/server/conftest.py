"""Server test helpers: a real ``xinserve serve`` subprocess on a free port, and OpenAI's schemas."""

import asyncio
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIR = REPO_ROOT / "tests" / "fixtures" / "openai-schemas"
# A server is ready in ~20 s on a quiet 2-core machine; loaded (CI, two xdist workers, other users: load
# 20-30 measured) the same start took 245 s. The wait ends as soon as the server is ready.
READY_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sse_events(response: httpx.Response) -> list[Any]:
    """Parsed ``data:`` payloads of a stream; "[DONE]" stays a string."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def check_chat_stream(events: list[Any], schemas: "Schemas", completion_tokens: int) -> str:
    """The shape every chat stream with ``include_usage`` must have (schema-valid chunks, one id, the
    role first, one "length" finish, a final usage-only chunk, then [DONE]); returns the streamed text."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        schemas.validate("CreateChatCompletionStreamResponse", chunk)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len({c["id"] for c in chunks}) == 1
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == completion_tokens
    assert all(c["usage"] is None for c in chunks[:-1])
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def concurrent_greedy_chats(
    url: str, api_key: str, model: str, prompts: list[str], max_tokens: list[int], timeout: float
) -> list[tuple[str, int | None, str | None]]:
    """One greedy streamed chat per prompt, all at once, through the openai SDK; each gives (text,
    completion tokens from the final usage chunk, finish reason)."""
    import openai

    async def one(ac: openai.AsyncOpenAI, prompt: str, limit: int) -> tuple[str, int | None, str | None]:
        stream = await ac.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=limit,
            temperature=0, stream=True, stream_options={"include_usage": True},
        )
        text, usage, reason = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage, reason

    async def run_all() -> list[tuple[str, int | None, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=timeout) as ac:
            return await asyncio.gather(*(one(ac, p, m) for p, m in zip(prompts, max_tokens)))

    return asyncio.run(run_all())


class ServerProcess:
    """``python -m xinserve.server.cli serve ARGS`` in a subprocess; ``url`` is ready once ``wait_ready`` returns."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115  closed in stop()
        self._terminated = False
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xinserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args],
            cwd=REPO_ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S, expect_status: int = 200) -> dict[str, Any]:
        """Poll /health until it answers ``expect_status`` (503 for a config with a broken model)."""
        return self._wait_health(timeout, lambda status, health: status == expect_status and self._settled(health))

    def wait_settled(self, timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """Poll /health until no worker is starting, whatever its status (some workers may have failed)."""
        return self._wait_health(timeout, lambda _status, health: self._settled(health))

    def _wait_health(self, timeout: float, done: Callable[[int, dict[str, Any]], bool]) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=5)
                last = r.json()
                if done(r.status_code, last):
                    return last
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not settled after {timeout}s; last health {last}:\n{self.log()[-4000:]}")

    @staticmethod
    def _settled(health: dict[str, Any]) -> bool:
        # Every worker has either come up or given up: no "starting" left (200 comes as soon as one
        # worker of each model is up, "degraded" while the others still load).
        return all(w["state"] != "starting" for w in health["workers"]) and not health.get("loading_tokenizers")

    def terminate(self) -> None:
        """SIGTERM once, without waiting for the server to end (``stop`` waits)."""
        if self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self) -> None:
        """SIGTERM (the server stops its workers in order), then kill if it hangs; idempotent."""
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self._log.closed:
            self._log.close()


def serve_config(start_server: Callable[..., ServerProcess], directory: Path, config: dict[str, Any],
                 settle: str = "ready") -> ServerProcess:
    """Start ``xinserve serve`` on ``config`` (written to ``directory``/config.yaml) and wait until it
    is ready (``settle="settled"``: until no worker is starting, some may have failed)."""
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    srv = start_server(["--config", str(path)])
    srv.wait_ready() if settle == "ready" else srv.wait_settled()
    return srv


SHORT_MAX_TOKENS = 4  # limits.max_tokens of ``short_tiny_server``: every generation stays short


@pytest.fixture(scope="session")
def short_tiny_server(start_server: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One model "tiny" on one CPU worker whose generations stay short (``SHORT_MAX_TOKENS``), shared
    by the fuzz modules (OpenAI's and Anthropic's APIs): one server start instead of one per module."""
    config = {
        "models": [{"name": "tiny", "path": str(tiny_model_dir), "workers": ["cpu"], "max_model_len": 512}],
        "limits": {"max_tokens": SHORT_MAX_TOKENS, "max_prompt_chars": 20_000},
    }
    return serve_config(start_server, tmp_path_factory.mktemp("short-tiny"), config)


EMBEDDED_KEY = "sk-xinserve-test"  # the one API key of ``embedded_server``


@pytest.fixture(scope="session")
def embedded_server(start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The README's first command: no --config and no --model (the embedded default "xinserve-tiny"),
    started from an empty cache directory (``.cache``; the model is built in ``.model_dir``), offline,
    with one API key. Shared by test_api.py and test_structured_api.py: one server start, not two."""
    cache = tmp_path_factory.mktemp("empty-cache")
    srv = start_server(["--api-key", EMBEDDED_KEY], env={"XINSERVE_CACHE_DIR": str(cache)})
    srv.wait_ready()
    srv.cache = cache
    srv.model_dir = cache / "xinserve-tiny"
    return srv


# The keys of ``keyed_server``: test_named_keys.py's three, then test_messages_api.py's two.
KEY_A = "sk-team-a-3f9c1e77d2"  # named "team-a", limited to "tiny"
KEY_B = "sk-team-b-b81f0a5c44"  # "team-b", read from the environment, every model
KEY_PLAIN = "sk-plain-6d2e90aa13"  # a plain string: named by its position ("key-3")
KEY_FULL = "sk-anthropic-full-81c2e0"  # "full", every model
KEY_OTHER = "sk-anthropic-other-5b7d13"  # "other-only", limited to "other"


@pytest.fixture(scope="session")
def keyed_server(start_server: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two models "tiny" and "other" (the tiny Llama, one CPU worker each, 4 sequences) behind named
    keys, some limited to one model. Shared by test_named_keys.py and anthropic/test_messages_api.py
    (each counts by deltas and checks only its own keys): one two-worker server start, not two."""
    model = {"path": str(tiny_model_dir), "workers": ["cpu"], "max_num_seqs": 4, "cpu_threads": 1}
    config = {
        "server": {"api_keys": [
            {"name": "team-a", "key": KEY_A, "models": ["tiny"]},
            {"name": "team-b", "key_env": "XINSERVE_TEST_KEY_B"},
            KEY_PLAIN,
            {"name": "full", "key": KEY_FULL},
            {"name": "other-only", "key": KEY_OTHER, "models": ["other"]},
        ]},
        "models": [{"name": "tiny", **model}, {"name": "other", **model}],
    }
    path = tmp_path_factory.mktemp("keyed") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    srv = start_server(["--config", str(path)], env={"XINSERVE_TEST_KEY_B": KEY_B})
    srv.wait_ready()
    srv.model_dir = tiny_model_dir
    return srv


# The models of ``assorted_server``, one per test file that needs a model configured its own way.
MLA_MODEL = "tiny-glm-5"  # a multi-head latent attention model with the DSA indexer (test_mla_serving.py)
SPEC_MODEL = "tiny-spec"  # n-gram speculative decoding (test_speculative_metrics.py)
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
KV_FLEET_MODEL = "tiny-kv"  # KV events and the host KV tier on a pool of 8 blocks (test_kv_fleet.py)


@pytest.fixture(scope="session")
def assorted_server(start_server: Any, tiny_models: Callable[..., Path], tiny_model_dir: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One server of three models, each on its own CPU worker, for the files that need a model set up
    their own way but not an HTTP process of their own: one server start instead of three (the HTTP
    process's imports are half of a start). Each file checks only its own model's metrics and worker;
    ``srv.kv_events`` is the KV events config of ``KV_FLEET_MODEL``."""
    directory = tmp_path_factory.mktemp("assorted")
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{directory}/kv",
                 "replay_endpoint": f"ipc://{directory}/kv-replay", "topic": "kv"}
    one = {"workers": ["cpu"], "cpu_threads": 1}
    config = {"models": [
        {"name": MLA_MODEL, "path": str(tiny_models("glm_moe_dsa")), **one},
        {"name": SPEC_MODEL, "path": str(tiny_model_dir), "speculative_config": SPEC_CONFIG, **one},
        {"name": KV_FLEET_MODEL, "path": str(tiny_model_dir), "num_kv_blocks": 8, "block_size": 16,
         "kv_offloading_size": 0.01, "kv_events_config": kv_events, **one},
    ]}
    srv = serve_config(start_server, directory, config)
    srv.kv_events = kv_events
    return srv


def wait_for(check: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Poll ``check()`` until it returns something truthy; the last value either way."""
    deadline = time.monotonic() + timeout
    value = check()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = check()
    return value


async def open_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[httpx.Response, Any]:
    """A streamed chat completion of ``body``, read up to its first content frame; the response and
    its remaining lines."""
    request = client.build_request("POST", "/v1/chat/completions", json=body)
    response = await client.send(request, stream=True)
    assert response.status_code == 200
    lines = response.aiter_lines()
    while '"content":"' not in (line := await anext(lines)) or '"content":""' in line:
        pass
    return response, lines


async def data_payloads(lines: Any) -> list[str]:
    """The ``data:`` payloads left in a stream's lines, as text."""
    return [line[5:].strip() async for line in lines if line.startswith("data:")]


async def first_tails(streams: list[tuple[httpx.Response, Any]]) -> list[list[str]]:
    """Read the ``open_stream`` streams' remaining payloads until one ends, then close them all;
    the payloads of those that ended."""
    tails = [asyncio.ensure_future(data_payloads(lines)) for _, lines in streams]
    done, pending = await asyncio.wait(tails, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    for response, _ in streams:
        await response.aclose()
    return [t.result() for t in done]


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    """A client of the module's ``server`` fixture."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``start(args, env) -> ServerProcess`` (not yet ready); every server is stopped at the end."""
    servers: list[ServerProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        log = tmp_path_factory.mktemp("server-log") / "server.log"
        server = ServerProcess(args, env or {}, log)
        servers.append(server)
        return server

    yield start
    for server in servers:  # all at once: each takes seconds to stop its workers
        server.terminate()
    for server in servers:
        server.stop()


def _openapi_nullable(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true`` (mixed into this 3.1 bundle) as JSON Schema's null branch."""
    if isinstance(node, dict):
        node = {k: _openapi_nullable(v) for k, v in node.items()}
        if node.pop("nullable", False) is True:
            return {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_openapi_nullable(v) for v in node]
    return node


class Schemas:
    def __init__(self, directory: Path) -> None:
        import jsonschema

        self._validators: dict[str, Any] = {}
        for path in directory.glob("*.json"):
            if path.name == "SOURCE.json":
                continue
            schema = _openapi_nullable(json.loads(path.read_text()))
            self._validators[path.stem] = jsonschema.Draft202012Validator(schema)

    def validate(self, name: str, instance: Any) -> None:
        """Raise ``jsonschema.ValidationError`` unless ``instance`` conforms to schema ``name``."""
        self._validators[name].validate(copy.deepcopy(instance))


@pytest.fixture(scope="session")
def schemas() -> Schemas:
    assert SCHEMA_DIR.is_dir(), f"OpenAI schemas fixture missing at {SCHEMA_DIR}"
    return Schemas(SCHEMA_DIR)


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """The embedded model's tokenizer, built in memory (byte-level BPE with a chat template)."""
    from xinserve.server.embedded_model.tokenizer import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def thinking_server(start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A server of the thinking model (tests/server/thinking_model.py) as "thinker" (qwen3 reasoning,
    hermes tool calls), two API keys. Here, not in thinking_model.py: a fixture imported into several
    modules is one fixture per module, and each started its own server."""
    from tests.server.thinking_model import KEYS, make_thinking_model

    directory = tmp_path_factory.mktemp("thinker")
    model = make_thinking_model(directory / "model")
    config = {
        "server": {"api_keys": list(KEYS)},
        "models": [{"name": "thinker", "path": str(model), "workers": ["cpu"], "max_model_len": 512,
                    "tool_call_parser": "hermes", "reasoning_parser": "qwen3"}],
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    server = start_server(["--config", str(path)])
    server.wait_ready()
    server.model_dir = model
    return server
