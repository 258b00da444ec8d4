"""Prompt text and token ids, both ways, such that a client's round trip through them is exact.

lm-eval's text mode (``local-completions``, ``tokenized_requests=False``) tokenises with ``/tokenize``,
turns the ids it scores back into text with ``/detokenize`` and sends that text to /v1/completions,
taking the ids to be those it started from. Two steps break that with a Llama (SentencePiece-style)
tokenizer, and then per-choice log-likelihoods drift from lm-eval's ``hf`` backend by varying
amounts (issue 38, item 9):

* ``decode([<s>, ▁Mom])`` is ``"<s> Mom"``: the decoder strips the dummy-prefix space only at the very
  start, but the tokenizer prepends one to each run of text after a special token, so the text comes
  back as ``[<s>, ▁, ▁Mom]``. ``prompt_text`` decodes run by run when that is what tokenises back.
* A prompt that begins with the BOS text got the tokenizer's BOS too: ``[<s>, <s>, …]``. lm-eval's
  ``hf`` backend (and llama.cpp's server) add none then; vLLM adds a second one.
"""

from typing import Any


def prompt_text(tokenizer: Any, ids: list[int]) -> str:
    """The text of ``ids`` that tokenises back to ``ids`` (without special tokens added) where the
    tokenizer allows: its own decoding when that does, else each run between special tokens decoded
    on its own (a tokenizer that prepends a space to every run strips it only at the start)."""
    text = tokenizer.decode(ids)
    if not _holds_special(tokenizer, ids) or _encodes_to(tokenizer, text, ids):
        return text
    by_runs = "".join(_runs(tokenizer, ids))
    return by_runs if _encodes_to(tokenizer, by_runs, ids) else text


def encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """``text``'s ids as a prompt: the tokenizer's, less the BOS it adds when the text's own first
    token is already that BOS (as lm-eval's ``hf`` backend encodes such a text)."""
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    bos = tokenizer.bos_token
    if add_special_tokens and bos and text.startswith(bos):
        plain = tokenizer.encode(text, add_special_tokens=False)
        bos_id = [tokenizer.bos_token_id]
        if plain[:1] == bos_id and ids[:1] == bos_id and ids[1:1 + len(plain)] == plain:
            return ids[1:]
    return ids


def _holds_special(tokenizer: Any, ids: list[int]) -> bool:
    special = set(tokenizer.all_special_ids)
    return any(t in special for t in ids)


def _encodes_to(tokenizer: Any, text: str, ids: list[int]) -> bool:
    return tokenizer.encode(text, add_special_tokens=False) == ids


def _runs(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each special token's text, and each run of other tokens between them decoded alone."""
    special = set(tokenizer.all_special_ids)
    parts: list[str] = []
    run: list[int] = []
    for token in ids:
        if token in special:
            if run:
                parts.append(tokenizer.decode(run))
                run = []
            parts.append(tokenizer.convert_ids_to_tokens(token))
        else:
            run.append(token)
    if run:
        parts.append(tokenizer.decode(run))
    return parts
