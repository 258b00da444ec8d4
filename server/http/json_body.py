"""What a JSON request body may hold, checked once on its bytes before any handler parses it.

Nesting: at most ``MAX_JSON_DEPTH`` arrays and objects deep. Real requests (tool schemas
included) nest a dozen levels; hundreds of levels in a 1 KB body made the chat templating recurse
until Python's limit (a 500 whose traceback was 470 KB of log). The same bound holds for JSON
carried in a string and parsed by the server (a tool call's ``arguments``): ``nested_deeper_than``.

Text: every string must be valid Unicode. JSON can spell an unpaired surrogate (``"\\ud800"``),
which Python's parser accepts but no tokenizer, and no UTF-8 encoder of a response, can take.
"""

import json
import re
from typing import Any

from xinserve.server.errors import APIError

MAX_JSON_DEPTH = 64

# Every byte but brackets and quotes goes; braces are read as brackets.
_BRACKETS_ONLY = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b'[]{}"')
# What may decode to a surrogate: its \u escape, or bytes that are not UTF-8 (Python's JSON parser
# decodes UTF-8-encoded surrogates with "surrogatepass").
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def nested_deeper_than(text: bytes | str, limit: int) -> bool:
    """Whether the JSON ``text`` nests arrays and objects more than ``limit`` deep (strings skipped).

    Without parsing (the parser itself would recurse), in a few passes of C over the bytes (a
    regular expression over an 8 MB body took half a second): escaped backslashes and quotes go,
    then everything but brackets and quotes, then what lies between quotes. Each round then deletes
    the innermost ``[]`` pairs, so a text ``limit`` deep is empty after ``limit`` rounds; malformed
    nesting that stops shrinking is left to the parser to reject."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    # Runs of backslashes pair off from the left, as JSON reads them; a quote left escaped is text.
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(unescaped.translate(_BRACKETS_ONLY, _NOT_BRACKETS).split(b'"')[::2])
    for _ in range(limit):
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            return False
        brackets = shorter
    return b"[]" in brackets


def check_json_body(body: bytes) -> APIError | None:
    """A 400 for a body nested past ``MAX_JSON_DEPTH`` or holding a string that is not valid
    Unicode (naming its field); None otherwise, malformed JSON included (the parser's to refuse)."""
    if nested_deeper_than(body, MAX_JSON_DEPTH):
        return APIError(400, f"The JSON body is nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays and "
                        f"objects are accepted.", code="invalid_value")
    if not _may_hold_surrogates(body):
        return None
    try:
        value = json.loads(body)
    except ValueError:  # UnicodeDecodeError too
        return None
    param = _bad_text_path(value)
    if param is None:
        return None
    return APIError(400, f"Invalid value for '{param}': the text holds an unpaired UTF-16 surrogate (such as "
                    f"\\ud800), which is not valid Unicode.", param=param, code="invalid_value")


def _may_hold_surrogates(body: bytes) -> bool:
    """False for almost every body, found by two scans in C without parsing it."""
    if _SURROGATE_ESCAPE.search(body):
        return True
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _bad_text_path(value: Any) -> str | None:
    """The dotted path ("messages.0.content") of the first string, or key, that is not valid
    Unicode ("body" for the body itself); None when every one is."""
    pending: list[tuple[tuple[str, ...], Any]] = [((), value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str) and not _encodes(item):
            return ".".join(path) or "body"
        if isinstance(item, dict):
            for key in item:
                if not _encodes(key):  # the path is echoed in the error: the key itself is not
                    return ".".join((*path, key.encode("utf-8", "backslashreplace").decode()))
            pending.extend(((*path, key), child) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            pending.extend(((*path, str(i)), child) for i, child in reversed(list(enumerate(item))))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
