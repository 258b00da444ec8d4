"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) over the chat path.

``protocol`` validates the request, ``convert`` turns it into the chat completions request it means
(one request path: the chat template, tool parsers, forced calls and the engine are the chat's),
``view`` renders the answer as a message or as Anthropic's events (``sse`` frames them), and
``errors`` gives every error on these paths Anthropic's shape.
"""

from xinserve.server.api.anthropic.errors import AnthropicErrorMiddleware
from xinserve.server.api.anthropic.routes import router

__all__ = ["AnthropicErrorMiddleware", "router"]
