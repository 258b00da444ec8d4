"""The ``data:`` frame of a chat chunk whose only news is content text, from pre-encoded bytes.

Nearly every chunk of a chat stream is ``{"id","object","created","model","choices":[{"index",
"delta":{"content"},"logprobs":null,"finish_reason":null}]}`` (and ``"usage":null`` with
``include_usage``), the same but for the text. Building its dicts and encoding them all again was a
measured share of the HTTP process's Python work per token (tests/server/api/test_stream_path_calls.py); here the
fixed parts are encoded once per stream and only the text is JSON-encoded per token. The bytes equal
``sse_frame(chat_chunk(...))``'s (tests/server/api/openai/test_chat_frames.py).
"""

import msgspec

_encode = msgspec.json.Encoder().encode  # the encoder sse_frame uses: the same escaping


class ContentFrames:
    """``frames(index, text)``: the frame of choice ``index`` gaining ``text`` (not empty)."""

    def __init__(self, request_id: str, created: int, model: str, with_usage: bool) -> None:
        head = _encode({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":[{"index":'  # the object left open
        self._tail = b'},"logprobs":null,"finish_reason":null}]' + (b',"usage":null' if with_usage else b"") + b"}\n\n"
        self._prefixes: dict[int, bytes] = {}

    def __call__(self, index: int, text: str) -> bytes:
        prefix = self._prefixes.get(index)
        if prefix is None:
            prefix = self._prefixes[index] = self._head + b"%d" % index + b',"delta":{"content":'
        return prefix + _encode(text) + self._tail
