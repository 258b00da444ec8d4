"""The engine's core: requests as sequences, the scheduler, the paged KV block manager, sampling params and outputs, and the step loop that ties them (engine.py)."""
