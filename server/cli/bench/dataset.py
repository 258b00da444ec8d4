"""What the bench sends: random word prompts, or a JSONL dataset with an optional category per line.

A dataset line is ``{"prompt": "..."}`` or ``{"messages": [...]}`` (a multi-turn chat), with
optional ``"category"`` (the per-category table groups by it) and ``"max_tokens"`` (else
``--output-tokens``).
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xinserve.server.cli.bad_input import BadInput, read_text

_WORDS = (
    "river", "harbour", "library", "morning", "bread", "market", "window", "garden", "silver", "letter",
    "mountain", "valley", "engine", "signal", "kitchen", "winter", "summer", "station", "ladder",
    "candle", "island", "forest", "bridge", "pocket", "shadow", "lantern", "thunder", "meadow",
    "compass", "anchor", "velvet", "marble", "saddle", "orchard", "whistle", "feather",
)


@dataclass(frozen=True, slots=True)
class Prompt:
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    category: str | None = None
    max_tokens: int | None = None


def random_words(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def random_prompts(num: int, words: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt(text=random_words(rng, words)) for _ in range(num)]


def load_jsonl(path: str | Path) -> list[Prompt]:
    """The dataset's prompts; BadInput naming the file, and the line, for anything else."""
    prompts = []
    for number, line in enumerate(read_text(path, "dataset").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise BadInput(f"{path}:{number}: give exactly one of 'prompt' and 'messages'")
        category, max_tokens = row.get("category"), row.get("max_tokens")
        if category is not None and not isinstance(category, str):
            raise BadInput(f"{path}:{number}: 'category' must be a string")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise BadInput(f"{path}:{number}: 'max_tokens' must be a positive integer")
        prompts.append(Prompt(messages=row.get("messages"), text=row.get("prompt"), category=category,
                              max_tokens=max_tokens))
    if not prompts:
        raise BadInput(f"{path}: no prompts")
    return prompts


def take(prompts: list[Prompt], num: int) -> list[Prompt]:
    """``num`` prompts, going round the list as often as needed."""
    return [prompts[i % len(prompts)] for i in range(num)]


def payload(prompt: Prompt, model: str, endpoint: str, max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    """A streamed, greedy request body for ``endpoint`` ("chat" or "completions")."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": prompt.max_tokens or max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension: exactly max_tokens tokens
    if endpoint == "chat":
        body["messages"] = prompt.messages or [{"role": "user", "content": prompt.text}]
    elif prompt.messages is not None:
        raise BadInput("a dataset with 'messages' needs the chat endpoint")
    else:
        body["prompt"] = prompt.text
    return body
