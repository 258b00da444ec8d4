"""The HTTP process's Python work per streamed chat token stays within a budget of function calls
(counted by cProfile: the same on a loaded machine as on a quiet one). Before the lighter queue,
the finished-choice count, the detokenizer's fast path and the pre-encoded content frames it was
196 calls per token here; 144 after; 122 with ordinary tokens written from the step callback
(server/stream_push.py; main without it: 143)."""

from benchmarks.stream_path_cpu import measure


def test_a_streamed_chat_token_costs_few_python_calls(tiny_model_dir):
    _, calls_per_token = measure(str(tiny_model_dir), concurrency=8, output_tokens=32, requests=8)
    assert calls_per_token < 135
