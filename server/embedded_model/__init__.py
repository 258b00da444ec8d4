"""The embedded tiny models (``path: embedded:<name>``, see ``server/embedded_model/resolve.py``), also built by
the tests and benchmarks: a locally trained tokenizer (``tokenizer.py``) and random Hugging Face
checkpoints of every supported architecture (``factory.py``)."""
