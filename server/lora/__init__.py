"""Multi-LoRA in the server: adapters named by a request's ``model`` field (``Router.resolve``), loaded
at start (``--lora-modules``, modules.py) or at run time (vLLM's endpoints, routes.py over updates.py)."""
