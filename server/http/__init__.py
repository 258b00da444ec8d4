"""The HTTP process's cross-cutting pieces: API keys, body limits, per-request limits, draining and graceful stop, request logs, metrics and the API docs."""
