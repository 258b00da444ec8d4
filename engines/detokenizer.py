"""Incremental detokenization with stop strings, for streaming and offline generation alike."""

from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded with the output so the first output token gets its leading space right
# (SentencePiece-style tokenizers drop it when a token is decoded on its own).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's new token ids into new text.

    ``add`` returns ``(new_text, stopped)``. The text never contains a stop string or anything
    after it (with ``include_stop_str_in_output``, it ends with the stop string); while the end of
    the text could be the start of a stop string, that part is held back (``flush`` returns it once
    generation ends for another reason). As in vLLM, stop strings only count once ``min_tokens``
    tokens are generated, and the text of a stop token (EOS or a ``stop_token_ids`` hit, passed
    with ``ends_with_stop_token``) is left out unless ``include_stop_str_in_output``. Each call
    decodes only a few tokens: the ones since the last complete character plus a little context.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
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
        self._ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0  # decoding starts here
        self._read_offset = len(self._ids)  # text of ids before this has been taken
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
        self._ids.extend(new_token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        # A trailing U+FFFD means a multi-byte character is still incomplete: wait for more tokens.
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            searched_from = max(0, len(self._text) - self._longest_stop() + 1)
            self._text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            if self.num_tokens >= self.min_tokens:
                self._truncate_at_stop(searched_from)
        end = len(self._text) if self.stopped else len(self._text) - self._partial_stop_len()
        if end <= self._emitted:
            return "", self.stopped
        delta, self._emitted = self._text[self._emitted : end], end
        return delta, self.stopped

    def flush(self) -> str:
        """Return whatever was held back as a possible stop-string start."""
        delta, self._emitted = self._text[self._emitted :], len(self._text)
        return delta

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
