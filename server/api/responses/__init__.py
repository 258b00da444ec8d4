"""OpenAI's Responses API (``/v1/responses``) on top of the chat path.

``protocol``: the request body. ``convert``: input items (and a stored conversation) -> the same
``ChatCompletionRequest`` chat completions runs, and an answer back -> chat messages to store.
``output``: the answer as output items and the stream's events. ``store``: responses kept for
``previous_response_id`` and ``GET``, per API key, bounded and expiring.
"""
