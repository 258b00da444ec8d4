"""Log-prob blocks of responses: token bytes and text offsets, with real tokenizers."""

import pytest
from transformers import AutoTokenizer

from xinserve.engines.core.detokenizer import text_offsets
from xinserve.engines.core.outputs import TokenLogprob
from xinserve.server.api.openai import view as responses
from xinserve.server.api.openai.view import TokenTexts
from xinserve.server.embedded_model.tokenizer import make_tokenizer


@pytest.fixture(scope="module")
def stories_tok(stories_dir):
    return AutoTokenizer.from_pretrained(stories_dir)


@pytest.fixture(scope="module")
def byte_level_tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _chat_entries(tok, token_ids: list[int]) -> list[dict]:
    """Chat log-probs of ``token_ids``, each listing the sequence's first tokens as alternatives."""
    entries = [TokenLogprob(-1.0, token_ids[:3], [-1.0, -2.0, -3.0]) for _ in token_ids]
    return responses.chat_logprobs(token_ids, entries, TokenTexts(tok), top=3)["content"]


def test_chat_logprob_bytes_of_byte_fallback_tokens_are_the_bytes(stories_tok):
    fox = "🦊".encode()
    ids = [stories_tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in fox]
    content = _chat_entries(stories_tok, ids)
    assert [e["bytes"] for e in content] == [[b] for b in fox]  # not U+FFFD's [239, 191, 189]
    assert [e["bytes"] for e in content[0]["top_logprobs"]] == [[b] for b in fox[:3]]
    assert all(e["token"] == "\ufffd" for e in content)  # the token's text is still its decoded text
    assert bytes(b for e in content for b in e["bytes"]).decode() == "🦊"


def test_chat_logprob_bytes_of_sentencepiece_words_keep_their_space(stories_tok):
    ids = stories_tok.encode("Once upon a time", add_special_tokens=False)
    content = _chat_entries(stories_tok, ids)
    assert [e["token"] for e in content] == [" Once", " upon", " a", " time"]
    assert [bytes(e["bytes"]) for e in content] == [b" Once", b" upon", b" a", b" time"]


def test_chat_logprob_bytes_of_byte_level_bpe_tokens_are_the_bytes(byte_level_tok):
    text = "naïve 北京 🦊"
    ids = byte_level_tok.encode(text, add_special_tokens=False)
    content = _chat_entries(byte_level_tok, ids)
    assert any(e["token"] == "\ufffd" for e in content)  # some tokens hold part of a character
    assert bytes(b for e in content for b in e["bytes"]) == text.encode()
    assert [e["bytes"] for e in content[0]["top_logprobs"]] == [e["bytes"] for e in content[:3]]


def _prompt_block(tok, ids: list[int], echo: str, skip_special: bool) -> dict:
    entries = [None] + [TokenLogprob(-1.0, [], []) for _ in ids[1:]]
    offsets = text_offsets(tok, ids, skip_special)
    return responses.prompt_logprobs(ids, entries, TokenTexts(tok), offsets, echo)


def test_echoed_sentencepiece_prompt_offsets_follow_its_text(stories_tok):
    prompt = "Once upon a time"
    ids = stories_tok.encode(prompt)  # <s> ▁Once ▁upon ▁a ▁time
    block = _prompt_block(stories_tok, ids, prompt, skip_special=True)
    assert block["text_offset"] == [0, 0, 4, 9, 11]  # was all 0: " Once" is not where "Once" starts
    as_ids = stories_tok.decode(ids)  # token-id prompts echo their decoded ids, "<s>" included
    assert _prompt_block(stories_tok, ids, as_ids, skip_special=False)["text_offset"] == [0, 3, 8, 13, 15]


def test_text_offsets_are_cumulative_decodes(stories_tok, byte_level_tok):
    for tok in (stories_tok, byte_level_tok):
        ids = tok.encode("Once upon a time, 北京 🦊 ran.")
        text = tok.decode(ids, skip_special_tokens=True)
        got = text_offsets(tok, ids)
        for i, offset in enumerate(got):
            before = tok.decode(ids[:i], skip_special_tokens=True)
            if before.endswith("\ufffd"):  # inside a character split over tokens: its start
                assert text[offset] in "北京🦊"
            else:
                assert offset == len(before)
        assert got == sorted(got)
