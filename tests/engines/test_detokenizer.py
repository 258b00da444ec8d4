import pytest
from transformers import AutoTokenizer

from engines.detokenizer import IncrementalDetokenizer
from engines.tiny_model import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[str, bool]:
    out, stopped = "", False
    for t in ids:
        delta, stopped = detok.add([t])
        out += delta
        if stopped:
            break
    return out, stopped


@pytest.mark.parametrize("text", ["Once upon a time, a little fox.", "naïve café — 北京 ✓ emoji 🦊!"])
def test_streamed_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Hello there.")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    out, stopped = stream(detok, ids)
    assert not stopped
    assert out + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_is_cut_and_never_emitted(tokenizer):
    ids = tokenizer.encode("The cat sat on the mat. The end.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["on the", "zzz"])
    out, stopped = stream(detok, ids)
    assert stopped
    assert out == "The cat sat "
    assert detok.text == "The cat sat "
    assert detok.add(ids[:1]) == ("", True)


def test_partial_stop_prefix_is_held_back_then_released(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["three four"])
    out, stopped = stream(detok, ids)
    assert not stopped
    assert out == "one two "  # "three" could still become "three four"
    assert detok.flush() == "three"


def test_real_sentencepiece_tokenizer_keeps_leading_space(stories_dir):
    tok = AutoTokenizer.from_pretrained(stories_dir)
    prompt = tok.encode("Once upon a time")
    ids = tok.encode("Once upon a time there was a dog", add_special_tokens=False)[len(prompt) - 1 :]
    detok = IncrementalDetokenizer(tok, prompt)
    out, _ = stream(detok, ids)
    assert out + detok.flush() == " there was a dog"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("on the cat sat on the mat", add_special_tokens=False)
    early = len(tokenizer.encode("on the", add_special_tokens=False))
    detok = IncrementalDetokenizer(tokenizer, [], stop=["on the"], min_tokens=early + 1)
    out, stopped = stream(detok, ids)
    assert stopped and out == "on the cat sat "  # the first "on the" came before min_tokens


def test_stop_string_kept_when_asked(tokenizer):
    ids = tokenizer.encode("The cat sat on the mat.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["on the"], include_stop_str_in_output=True)
    out, stopped = stream(detok, ids)
    assert stopped and out == "The cat sat on the"


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out_unless_asked(tokenizer, include):
    ids = tokenizer.encode("The cat sat", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], include_stop_str_in_output=include)
    out, _ = detok.add(ids[:-1])
    last, _ = detok.add(ids[-1:], ends_with_stop_token=True)
    assert out + last + detok.flush() == ("The cat sat" if include else tokenizer.decode(ids[:-1]))
