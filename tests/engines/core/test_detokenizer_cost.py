"""The HTTP process's detokenising is O(new tokens) per step: the tokenizer never re-decodes a tail
that grows with the output. A wrapper counts the ids each ``decode`` call is given."""

import pytest
from transformers import AutoTokenizer

from xinserve.engines.core.detokenizer import CONTEXT_TOKENS, MAX_HELD_TOKENS, IncrementalDetokenizer
from xinserve.server.embedded_model.tokenizer import make_tokenizer

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. "
         "One day, she saw a big, red ball in the park. naïve café — 北京 ✓ 🦊! ")


class CountingTokenizer:
    """Forwards to a real tokenizer; records how many ids each ``decode`` was given."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.decoded: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def decode(self, ids, **kwargs) -> str:
        self.decoded.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)


def stream_cost(tokenizer, prompt: list[int], ids: list[int]) -> tuple[str, list[int]]:
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, prompt, stop=["never in this story"])
    text = "".join(detok.add([t])[0] for t in ids)
    return text + detok.flush(), counting.decoded


@pytest.mark.parametrize("kind", ["sentencepiece", "byte_level"])
def test_each_token_decodes_a_bounded_window(kind, stories_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(stories_dir) if kind == "sentencepiece" else make_tokenizer(tmp_path)
    prompt = tokenizer.encode("A story.", add_special_tokens=False)
    ids = tokenizer.encode(STORY * 12, add_special_tokens=False)
    text, decoded = stream_cost(tokenizer, prompt, ids)
    whole = tokenizer.decode(prompt + ids, skip_special_tokens=True)
    assert text == whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):]
    # Each step decodes its new tokens after a few of context, never the output so far.
    window = CONTEXT_TOKENS + 2 * (MAX_HELD_TOKENS + 1)
    assert max(decoded, default=0) <= window
    assert sum(decoded) <= 3 * window * len(ids) // 4  # on average, a few ids per token
    _, half = stream_cost(tokenizer, prompt, ids[: len(ids) // 2])
    assert sum(decoded) <= 2 * sum(half) + window  # twice the tokens: twice the work, not four times
