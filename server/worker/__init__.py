"""The engine worker process: its step loop around an LLMEngine, its messages to and from the HTTP process, and the follower nodes of a multi-node replica."""
