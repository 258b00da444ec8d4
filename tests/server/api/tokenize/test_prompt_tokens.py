"""Prompt text and ids round-trip exactly on the stories260K Llama tokenizer (a SentencePiece-style
tokenizer that prepends a space to every run of text after a special token)."""

import pytest
from transformers import AutoTokenizer

from xinserve.server.api.tokenize.prompt_tokens import encode_prompt, prompt_text

BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def tok(stories_dir):
    return AutoTokenizer.from_pretrained(stories_dir)


@pytest.mark.parametrize("text", ["<s>Mom went out.", "Mom went out.</s><s>Tom ran.", "Mom</s>went", "Mom went out."])
def test_detokenized_text_tokenizes_back_to_the_same_ids(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.encode(prompt_text(tok, ids), add_special_tokens=False) == ids


def test_detokenizing_plain_text_is_the_tokenizers_own_decoding(tok):
    ids = tok.encode("Mom went to the park.", add_special_tokens=False)
    assert prompt_text(tok, ids) == tok.decode(ids)


def test_the_bos_text_decodes_without_the_space_that_would_add_a_token(tok):
    ids = [BOS, *tok.encode("Mom went out.", add_special_tokens=False)]
    assert tok.decode(ids) == "<s> Mom went out."  # what the tokenizer alone gives: one token more
    assert prompt_text(tok, ids) == "<s>Mom went out."


def test_a_prompt_that_begins_with_the_bos_text_gets_no_second_bos(tok):
    assert encode_prompt(tok, "<s>Mom went out.") == encode_prompt(tok, "Mom went out.")
    assert encode_prompt(tok, "<s>Mom went out.")[:2] == [BOS, tok.encode("Mom", add_special_tokens=False)[0]]


def test_bos_text_elsewhere_or_twice_is_kept(tok):
    assert encode_prompt(tok, "<s><s>Mom")[:3] == [BOS, BOS, 392]  # only the one BOS the tokenizer adds goes
    assert encode_prompt(tok, "Mom</s><s>Tom").count(BOS) == 2
    assert encode_prompt(tok, "<s>Mom", add_special_tokens=False) == [BOS, 392, 287]
