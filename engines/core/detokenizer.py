"""Incremental detokenization with stop strings, for streaming and offline generation alike."""

import codecs
from typing import TYPE_CHECKING

from xinserve.engines.core.token_bytes import token_bytes_of

if TYPE_CHECKING:  # a type only: the HTTP process imports this before transformers (server/http/heavy_imports.py)
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded with the output so the first output token gets its leading space right
# (SentencePiece-style tokenizers drop it when a token is decoded on its own).
CONTEXT_TOKENS = 5
# Tokens held back waiting for the end of a character (decoded with the tokenizer): a character
# has at most 4 bytes, so only pieces that each split one reach this (byte-level pieces behind a
# decoder that is more than plain byte-level; never byte-fallback's one byte per token).
MAX_HELD_TOKENS = 4


class IncrementalDetokenizer:
    """Turns one sequence's new token ids into new text.

    ``add`` returns ``(new_text, stopped)``. The text never contains a stop string or anything
    after it (with ``include_stop_str_in_output``, it ends with the stop string); while the end of
    the text could be the start of a stop string, that part is held back. As in vLLM, stop strings
    only count once ``min_tokens`` tokens are generated, and the text of a stop token (EOS or a
    ``stop_token_ids`` hit, passed with ``ends_with_stop_token``) is left out unless
    ``include_stop_str_in_output``. ``flush`` (once generation ends for another reason) returns all
    that was held back.

    Characters split over tokens (byte-fallback ``<0xE4>``, byte-level BPE pieces): the tokens' own
    bytes (``TokenBytes``) tell where a character ends, so only the tokens of the last, incomplete
    character are held back (at most 3 bytes); invalid bytes are U+FFFD at once, and an incomplete
    character still pending at the end is decoded by ``flush`` as the tokenizer decodes it. Where the
    tokenizer's text is just its tokens' bytes as UTF-8 (a plain byte-level decoder), the bytes are
    decoded here directly. Otherwise each call decodes a few tokens at most (the newly complete ones,
    after the previous ones as context); either way a long output costs time linear in its length.
    """

    def __init__(
        self,
        tokenizer: "PreTrainedTokenizerBase",
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.num_tokens = 0  # output tokens seen, the stop token included
        self._bytes = token_bytes_of(tokenizer)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # tracks where characters end
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0  # decoding starts here
        self._read_offset = len(self._ids)  # text of ids before this has been taken
        self._complete = len(self._ids)  # ids before this end on a character boundary
        self._text = ""
        self._emitted = 0  # characters of _text already returned
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text (Anthropic reports it)

    @property
    def text(self) -> str:
        """All output text so far (without any stop string)."""
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int], ends_with_stop_token: bool = False) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self.num_tokens += len(new_token_ids)
        if ends_with_stop_token and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        if self._bytes.bytes_are_text:
            text = "".join([self._utf8.decode(self._token_bytes(t)) for t in new_token_ids])
            if not self.stop:  # nothing to find or hold back: the new characters are the delta
                self._text += text
                self._emitted = len(self._text)
                return text, False
            self._extend(text)
            return self._release()
        for token_id in new_token_ids:
            self._append(token_id)
        end = self._complete
        if len(self._ids) - end > MAX_HELD_TOKENS:
            # Every token here splits a character (byte-level pieces can): give up on joining them.
            end = self._complete = len(self._ids)
            self._utf8.reset()
        self._take(end)
        return self._release()

    def add_each(self, new_token_ids: list[int], ends_with_stop_token: bool = False) -> tuple[str, bool, int]:
        """``add`` one token at a time, exactly as steps of one token each would: several tokens come
        at once from a speculative step, and the output must end at the token whose text completes a
        stop string, not after the step's later tokens. Returns (new text, stopped, how many of
        ``new_token_ids`` the output keeps)."""
        if len(new_token_ids) < 2:
            text, stopped = self.add(new_token_ids, ends_with_stop_token)
            return text, stopped, len(new_token_ids)
        text = ""
        for i, token in enumerate(new_token_ids):
            delta, stopped = self.add([token], ends_with_stop_token and i == len(new_token_ids) - 1)
            text += delta
            if stopped:
                return text, True, i + 1
        return text, False, len(new_token_ids)

    def flush(self) -> str:
        """Once generation has ended: everything held back, an incomplete character's bytes included
        (as the tokenizer decodes them: U+FFFD)."""
        if not self.stopped and self._bytes.bytes_are_text:
            self._extend(self._utf8.decode(b"", final=True))
        elif not self.stopped:
            self._take(len(self._ids))
            self._utf8.reset()
        delta, self._emitted = self._text[self._emitted :], len(self._text)
        return delta

    def _token_bytes(self, token_id: int) -> bytes:
        if self.skip_special_tokens and token_id in self._bytes.special_ids:
            return b""
        raw = self._bytes(token_id)
        return self._decode([token_id]).encode("utf-8") if raw is None else raw  # None: not in the vocabulary

    def _append(self, token_id: int) -> None:
        if self.skip_special_tokens and token_id in self._bytes.special_ids:
            return  # decoded to nothing: kept out of every window
        self._ids.append(token_id)
        raw = self._bytes(token_id)
        if not raw:  # a tokenizer whose tokens never split a character
            self._utf8.reset()
            self._complete = len(self._ids)
            return
        # Only the decoder's state matters: the bytes of the character not finished yet.
        unfinished = self._utf8.getstate()[0]
        continued = bool(unfinished) and not self._utf8.decode(raw[:1]).startswith("\ufffd")
        self._utf8.decode(raw[1:] if unfinished else raw)
        if not self._utf8.getstate()[0]:
            self._complete = len(self._ids)
        elif not continued:  # no character spans the start of this token
            self._complete = len(self._ids) - 1

    def _take(self, end: int) -> None:
        """Append the text of ``_ids[_read_offset:end]`` to ``_text``, decoded after the tokens before it."""
        if end <= self._read_offset:
            return
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset : end])
        if not full.startswith(prefix):
            # The context reads differently next to the new tokens (byte-fallback decodes a run of
            # bytes with an invalid one as all U+FFFD): take the new tokens' own text.
            full = prefix + self._decode(self._ids[self._read_offset : end])
        if len(full) <= len(prefix):
            return  # nothing yet (e.g. a lone space the tokenizer strips): wait for more
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._extend(full[len(prefix) :])

    def _extend(self, text: str) -> None:
        searched_from = max(0, len(self._text) - self._longest_stop() + 1)
        self._text += text
        if self.num_tokens >= self.min_tokens:
            self._truncate_at_stop(searched_from)

    def _release(self) -> tuple[str, bool]:
        end = len(self._text) if self.stopped else len(self._text) - self._partial_stop_len()
        if end <= self._emitted:
            return "", self.stopped
        delta, self._emitted = self._text[self._emitted : end], end
        return delta, self.stopped

    def _longest_stop(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def _truncate_at_stop(self, start: int) -> None:
        hits = [(i, s) for i, s in ((self._text.find(s, start), s) for s in self.stop) if i >= 0]
        if hits:
            index, stop = min(hits)
            self._text = self._text[: index + (len(stop) if self.include_stop_str_in_output else 0)]
            self.stopped, self.stop_string = True, stop

    def _partial_stop_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best


def text_offsets(tokenizer: "PreTrainedTokenizerBase", token_ids: list[int], skip_special_tokens: bool = True) -> list[int]:
    """Where each token's text starts in ``decode(token_ids)``: ``len(decode(token_ids[:i]))``, in one
    linear pass. A token inside a character split over tokens gets that character's start."""
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
    offsets = []
    for token_id in token_ids:
        offsets.append(len(detok.text))
        detok.add([token_id])
    return offsets
