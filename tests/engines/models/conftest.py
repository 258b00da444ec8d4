"""Model tests never reach the Hub: set before transformers is first imported by the tests here."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
