"""OpenAI's chat completions, completions and models endpoints: request models (protocol), response bodies (view), routes."""
