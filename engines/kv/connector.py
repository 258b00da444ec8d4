"""KV connectors: a tier outside the device's KV pool, keyed by the prefix cache's block hashes.

A connector has three per-block operations, which the engine drives between scheduling a step and
running it (engines/core/engine.py):
- ``contains(block_hash, token_ids) -> bool``: lookup, by the block manager while it admits a prompt,
  for the blocks past the pool's own prefix hits (engines/core/kv_cache.py ``external_blocks``);
- store: ``transfer`` copies the full, cached blocks the pool evicted this step out of it;
- load: ``transfer`` copies the looked-up blocks into the pool blocks allocated for them, before the
  step's forward reads them.
Plus ``clear()`` (the prefix cache was reset: nothing may be served from before) and ``report()``
(for /health). ``host.HostKVConnector`` keeps the blocks in host memory; a Mooncake or LMCache
connector implements the same methods over its transfer engine.
"""
