import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from xinserve.engines.core.detokenizer import IncrementalDetokenizer
from xinserve.engines.core.token_bytes import BYTE_LEVEL_ALPHABET
from xinserve.server.embedded_model.tokenizer import make_tokenizer


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


class CountingTokenizer:
    """Delegates to a real tokenizer and counts the token ids it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded_ids = 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def stories_tok(stories_dir):
    return AutoTokenizer.from_pretrained(stories_dir)


def byte_ids(tok, data: bytes) -> list[int]:
    return tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in data])


def words(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def streamed_and_final(tok, ids: list[int]) -> tuple[str, str, str]:
    """The streamed text, the final text, and what decoding the whole sequence gives after the prompt."""
    prompt = tok.encode("Once upon a time")
    detok = IncrementalDetokenizer(tok, prompt)
    out, _ = stream(detok, ids)
    whole = tok.decode(prompt + ids, skip_special_tokens=True)
    return out + detok.flush(), detok.text, whole[len(tok.decode(prompt, skip_special_tokens=True)):]


@pytest.mark.parametrize("case", ["chars", "dangling", "invalid_run", "only_bytes"])
def test_byte_fallback_text_equals_full_decode(stories_tok, case):
    tok = stories_tok
    ids = {
        "chars": [*words(tok, "a fox"), *byte_ids(tok, "中🦊".encode()), *words(tok, " ran"),
                  *byte_ids(tok, "é".encode())],
        "dangling": [*words(tok, "a fox"), *byte_ids(tok, "🦊".encode()[:2])],  # ends inside a character
        "invalid_run": [*words(tok, "a fox"), *byte_ids(tok, b"\x80" * 7), *words(tok, " ran")],
        "only_bytes": byte_ids(tok, bytes([0x80 + i % 64 for i in range(300)])),  # was "" in the end
    }[case]
    streamed, final, decoded = streamed_and_final(tok, ids)
    assert streamed == final == decoded


def test_byte_level_bpe_dangling_character_is_flushed(tokenizer):
    ids = tokenizer.encode("a fox 🦊", add_special_tokens=False)
    cut = next(i for i in range(len(ids), 0, -1) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    streamed, final, decoded = streamed_and_final(tokenizer, ids[:cut])
    assert streamed == final == decoded == tokenizer.decode(ids[:cut]) and final.endswith("\ufffd")


def test_only_an_unfinished_character_is_held_back(stories_tok):
    detok = IncrementalDetokenizer(stories_tok, stories_tok.encode("Once"))
    fox = byte_ids(stories_tok, "🦊".encode())
    assert [detok.add([t])[0] for t in fox] == ["", "", "", "🦊"]
    assert detok.add(byte_ids(stories_tok, b"\x80")) == ("\ufffd", False)  # invalid: out at once
    assert detok.add(byte_ids(stories_tok, b"\xe4\xb8")) == ("", False)
    assert detok.flush() == "\ufffd\ufffd"  # as decode gives an unfinished character at the end


def test_long_byte_runs_cost_linear_work(stories_tok):
    """A run of bytes that never makes a character was re-decoded from its start at every token."""
    counting = CountingTokenizer(stories_tok)
    ids = byte_ids(stories_tok, bytes([0x80 + i % 64 for i in range(2000)]))
    detok = IncrementalDetokenizer(counting, stories_tok.encode("Once"))
    out, _ = stream(detok, ids)
    assert counting.decoded_ids < 10 * len(ids)
    assert out + detok.flush() == "\ufffd" * len(ids)


def test_byte_level_pieces_that_split_characters_hold_back_only_the_unfinished_one():
    """Pieces like b"\\xb8\\xad\\xe4" end every token inside a character; only its bytes may wait."""
    char_of = {b: c for c, b in BYTE_LEVEL_ALPHABET.items()}
    pieces = [bytes([b]) for b in range(256)] + [b"a\xe4", b"\xb8\xad\xe4"]
    vocab = {"".join(char_of[b] for b in p): i for i, p in enumerate(pieces)}
    backend = Tokenizer(models.BPE(vocab, []))
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    ids = [256] + [257] * 50  # "a" + "中" * 50, then a first byte
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add([t])[0] for t in ids] == ["a"] + ["中"] * 50
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(ids)
