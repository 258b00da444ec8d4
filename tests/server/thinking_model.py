"""A tiny model that always writes the same reasoning, answer and tool call, for the reasoning tests.

Its tokenizer is the tiny one plus ``<think>``, ``</think>``, ``<tool_call>``, ``</tool_call>`` and
one call as added (non-special) tokens. Its weights are the random tiny Llama's with one change: each
token of ``CHAIN`` gets a large input embedding along its own basis direction, and the output row of
the next token of the chain points the same way, so after chain token i the model's greedy choice
is token i + 1 whatever else is in the context (the residual stream is dominated by the current
token's embedding). Its chat template ends the generation prompt with ``<|assistant|>``, the chain's
start, and follows ``enable_thinking: false`` (an empty ``<think></think>``) and ``think_open``
(the prompt ends with ``<think>``, as reasoning templates that open the block themselves).
"""

import itertools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from xinserve.server.embedded_model.factory import make_tiny_model

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", CALL]
REASONING = " river stars"
ANSWER = " The light"
# The greedy output after "<|assistant|>"; the chain then ends on EOS.
CHAIN = ["<|assistant|>", "<think>", " river", " stars", "</think>", " The", " light", "<tool_call>", CALL,
         "</tool_call>", "<|end_of_text|>"]
TEMPLATE = (
    "{{ bos_token }}"
    "{% if reasoning_effort is defined %}<|system|>\neffort {{ reasoning_effort }}{{ eos_token }}\n{% endif %}"
    "{% if tools %}<|system|>\n{% for tool in tools %}{{ tool.function.name }} {% endfor %}{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{% elif think_open is defined and think_open %}<think>{% endif %}"
    "{% endif %}"
)
_EMBED, _HEAD = 400.0, 10.0


def make_thinking_model(path: Path) -> Path:
    make_tiny_model(path, vocab_size=1008, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(ADDED)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    ids = [_one_id(tokenizer, text) for text in CHAIN]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        for k, (token, following) in enumerate(itertools.pairwise(ids)):
            embed[token] = 0
            embed[token, k] = _EMBED
            head[following] = 0
            head[following, k] = _HEAD
    model.save_pretrained(path)
    return path


def _one_id(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is not one token: {ids}"
    return ids[0]


KEYS = ("key-a", "key-b")
