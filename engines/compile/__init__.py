"""The CPU decode buckets compiled in a child process into artifacts the worker loads (engines/worker/warmup.py)."""
