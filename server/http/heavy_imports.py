"""The HTTP process's heavy imports, taken after its workers are spawned and one thread at a time.

``import xinserve.server.app`` stays free of torch, transformers and xgrammar (they were ~8 of its 9.6 CPU s;
tests/server/http/test_light_imports.py pins it): a server spawns its workers first and imports them beside
the workers' start, in the threads that load a tokenizer, build the embedded model or check a first
JSON schema. (The tokenizer's load imports nearly all of them: this moves their cost, not saves it.)

transformers imports its classes lazily, and that import is not thread-safe: two models loading their
tokenizers in two threads at once failed with "cannot import name 'AutoTokenizer'". Everything in the
HTTP process that may import transformers (xgrammar does too) holds ``IMPORT_LOCK`` while it does.
"""

import importlib
import sys
import threading
from types import ModuleType

IMPORT_LOCK = threading.Lock()


def load(name: str) -> ModuleType:
    """``importlib.import_module(name)`` while holding ``IMPORT_LOCK`` (no wait once it is imported)."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    with IMPORT_LOCK:
        return importlib.import_module(name)
