"""xinserve's OpenAI-compatible HTTP server: routes, router, worker processes and the CLI."""
