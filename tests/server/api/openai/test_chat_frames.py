"""A content-only chat chunk framed from pre-encoded bytes is the frame the dict path builds."""

import pytest

from xinserve.server.api.common import sse_frame
from xinserve.server.api.openai.chat_frames import ContentFrames
from xinserve.server.api.openai.view import chat_chunk, chunk_choice

TEXTS = ["Hello", " there", '"quoted" \\ back', "tab\tnew\nline\r\x00\x1f\x7f", "café 😀 日本", "\ufffd", "</script>",
         "\u2028\u2029"]


@pytest.mark.parametrize("with_usage", [False, True])
def test_a_content_frame_equals_the_encoded_chunk(with_usage):
    frames = ContentFrames("chatcmpl-0123abcd", 1767225600, 'm/"odd" model', with_usage)
    for index in (0, 1, 12):
        for text in TEXTS:
            chunk = chat_chunk("chatcmpl-0123abcd", 1767225600, 'm/"odd" model',
                               [chunk_choice(index, {"content": text})], with_usage=with_usage)
            assert frames(index, text) == sse_frame(chunk)


def test_a_frame_passes_through_sse_frame_untouched():
    frame = ContentFrames("r", 1, "m", False)(0, "x")
    assert sse_frame(frame) is frame
