"""Token id -> the raw bytes it stands for, read from the token itself rather than from decoding it.

Decoding one token that holds part of a multi-byte character gives U+FFFD, which says nothing about
the bytes. The token's own piece does: a SentencePiece byte-fallback piece ``<0xF0>`` is byte 0xF0
(and ``▁`` in other pieces is a space); a byte-level BPE piece (GPT-2 style) spells its bytes with
one printable stand-in character each; a tiktoken-style slow tokenizer hands out the bytes directly.
Added tokens (specials included) are their text, which a byte-level decoder maps through its
alphabet like any piece. Other tokenizers never split a character, so they answer None and the
token's decoded text is its bytes.
"""

import json
import re
import weakref
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's stand-in character -> byte: printable Latin-1 bytes stand for themselves, the other
    68 bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in alphabet.values()]
    alphabet.update({chr(256 + i): b for i, b in enumerate(others)})
    return alphabet


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


def _decoder_spec(tokenizer: Any) -> dict | None:
    """The fast tokenizer's decoder as its JSON description (None: no fast decoder)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return None if decoder is None else json.loads(decoder.__getstate__())


def _decoder_kind(tokenizer: Any, spec: dict | None) -> str:
    """"byte_level", "sentencepiece" or "other", from the fast tokenizer's decoder (or a slow one's model)."""
    if spec is None:
        return "sentencepiece" if getattr(tokenizer, "sp_model", None) is not None else "other"
    text = json.dumps(spec, ensure_ascii=False)
    if '"ByteLevel"' in text:
        return "byte_level"
    if '"ByteFallback"' in text or '"Metaspace"' in text or "▁" in text:
        return "sentencepiece"
    return "other"


class TokenBytes:
    """``token_bytes(token_id)``: the token's raw bytes, or None where its decoded text is them.

    Cached per id: log-probs and the detokenizer ask for the same ids again and again.
    ``special_ids``: the tokens ``decode(..., skip_special_tokens=True)`` leaves out.
    ``bytes_are_text``: ``decode(ids)`` is exactly the UTF-8 decoding (U+FFFD for bad bytes) of the
    ids' bytes joined: a plain byte-level decoder, every token (added ones too) through its alphabet,
    and no clean-up of spaces afterwards.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        spec = _decoder_spec(tokenizer)
        self.kind = _decoder_kind(tokenizer, spec)
        self.bytes_are_text = (
            spec is not None and spec.get("type") == "ByteLevel"
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        )
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._added = {token_id: str(token) for token_id, token in added.items()}
        self.special_ids = {token_id for token_id, token in added.items() if getattr(token, "special", False)}
        self.special_ids.update(getattr(tokenizer, "all_special_ids", []))
        self._cache: dict[int, bytes | None] = {}

    def __call__(self, token_id: int) -> bytes | None:
        if token_id in self._cache:
            return self._cache[token_id]
        raw = self._bytes(token_id)
        self._cache[token_id] = raw
        return raw

    def _bytes(self, token_id: int) -> bytes | None:
        if token_id in self._added and self.kind != "byte_level":  # a byte-level decoder maps them too
            return self._added[token_id].encode("utf-8")
        piece = self._added.get(token_id) or self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, bytes):
            return piece
        if not isinstance(piece, str):
            return None
        if self.kind == "byte_level":
            if all(c in BYTE_LEVEL_ALPHABET for c in piece):
                return bytes(BYTE_LEVEL_ALPHABET[c] for c in piece)
            return piece.encode("utf-8")
        if self.kind == "sentencepiece":
            match = _BYTE_PIECE.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return piece.replace("▁", " ").encode("utf-8")
        return None


_SHARED: "weakref.WeakKeyDictionary[Any, TokenBytes]" = weakref.WeakKeyDictionary()


def token_bytes_of(tokenizer: Any) -> TokenBytes:
    """The one ``TokenBytes`` of ``tokenizer``, so its cache outlives a request."""
    found = _SHARED.get(tokenizer)
    if found is None:
        found = _SHARED[tokenizer] = TokenBytes(tokenizer)
    return found
