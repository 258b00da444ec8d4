"""The reasoning parsers on whole outputs and on every way of cutting them into stream deltas."""

import itertools

import pytest

from xinserve.server.api.reasoning import ThinkSplitter, reasoning_for
from xinserve.server.api.reasoning.parsers import starts_in_reasoning, thinking_disabled

CASES = [
    # (starts inside, output, reasoning, content)
    (False, "<think>Let me see.</think>The answer is 4.", "Let me see.", "The answer is 4."),
    (False, "\n<think>\nhm\n</think>\n\nYes", "\nhm\n", "\n\n\nYes"),  # text before the tag is content
    (False, "No reasoning here.", None, "No reasoning here."),
    (False, "Text <think>late</think> end", "late", "Text  end"),
    (False, "<think>cut by max_tokens", "cut by max_tokens", ""),
    (False, "<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),  # one block only
    (True, "inside</think>answer", "inside", "answer"),
    (True, "<think>leading tag dropped</think>x", "leading tag dropped", "x"),
    (True, "never closed", "never closed", ""),
    (True, "</think>", "", ""),
    (False, "a </th b", None, "a </th b"),  # a tag's prefix that never completes is text
    (True, "ends mid-tag </thi", "ends mid-tag </thi", ""),
]


@pytest.mark.parametrize(("inside", "text", "reasoning", "content"), CASES)
def test_whole_output(inside, text, reasoning, content):
    assert ThinkSplitter(inside).split(text) == (reasoning, content)


@pytest.mark.parametrize(("inside", "text", "reasoning", "content"), CASES)
def test_every_two_and_three_way_cut_streams_the_same(inside, text, reasoning, content):
    """Deltas cut anywhere (inside a tag too) add up to the whole answer, and no tag text leaks."""
    cuts = [c for n in (1, 2) for c in itertools.combinations(range(1, len(text)), n)]
    for cut in cuts:
        bounds = [0, *cut, len(text)]
        splitter = ThinkSplitter(inside)
        parts = [splitter.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [splitter.finish()]
        assert "".join(p.reasoning for p in parts) == (reasoning or ""), cut
        assert "".join(p.content for p in parts) == content, cut


def test_one_character_at_a_time_never_shows_a_tag():
    splitter = ThinkSplitter(False)
    pieces = [splitter.feed(ch) for ch in "<think>abc</think>xyz"] + [splitter.finish()]
    assert all("<" not in p.reasoning + p.content for p in pieces)
    assert [p.reasoning for p in pieces if p.reasoning] == ["a", "b", "c"]


def test_parser_rules():
    assert starts_in_reasoning("deepseek_r1", "<|assistant|>")
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n")
    assert starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n")  # Qwen3 thinking-2507
    assert not starts_in_reasoning("qwen3", "<think>\n\n</think>\n\n")  # enable_thinking false
    # GLM: an earlier turn's open block does not count, the last assistant turn's does (GLM-4.7/5)
    assert not starts_in_reasoning("glm45", "<think><|assistant|>")
    assert starts_in_reasoning("glm45", "<|user|>hi<|assistant|><think>")
    assert thinking_disabled("qwen3", {"enable_thinking": False})
    assert thinking_disabled("glm45", {"enable_thinking": False})
    assert not thinking_disabled("qwen3", {"enable_thinking": True}) and not thinking_disabled("qwen3", None)
    assert not thinking_disabled("deepseek_r1", {"enable_thinking": False})  # R1 always reasons


def test_reasoning_for_reads_the_prompt(tiny_tokenizer):
    tiny_tokenizer.add_tokens(["<think>", "</think>"])
    open_ids = tiny_tokenizer.encode("<|assistant|>\n<think>", add_special_tokens=False)
    closed_ids = tiny_tokenizer.encode("<|assistant|>\n<think></think>", add_special_tokens=False)
    assert reasoning_for(None, tiny_tokenizer, open_ids, None) is None
    assert reasoning_for("qwen3", tiny_tokenizer, open_ids, {"enable_thinking": False}) is None
    assert reasoning_for("qwen3", tiny_tokenizer, open_ids, None)().split("a</think>b") == ("a", "b")
    assert reasoning_for("deepseek_r1", tiny_tokenizer, open_ids, None)().split("a</think>b") == ("a", "b")
    # A prompt that ends by closing the block (a template's "thinking off"): no reasoning, no waiting grammar.
    assert reasoning_for("qwen3", tiny_tokenizer, closed_ids, None) is None
    assert reasoning_for("deepseek_r1", tiny_tokenizer, closed_ids, None) is None
    plain_ids = tiny_tokenizer.encode("<|assistant|>\n", add_special_tokens=False)
    assert reasoning_for("qwen3", tiny_tokenizer, plain_ids, None)().split("a</think>b") == (None, "a</think>b")
