"""Short garbage-collector pauses in a serving process: ``freeze_heap()`` once its startup is over.

CPython's cyclic collector now and then runs a full pass over every object it tracks. A serving process
has torch, transformers and sympy loaded, ~250,000 objects: a full pass there takes 107-133 ms (measured
in the HTTP process on a 2-core AVX-512 machine), and every stream in flight stalls for it, the worker's
steps or the HTTP process's token output alike. (The rare 50-200 ms inter-token gaps seen at c=32 stayed
after freezing: their cause is another, not found yet.) ``gc.freeze()`` moves every object alive now to the permanent
generation, which collections skip: a full pass then walks only what was made since (0.0 ms right after).
What startup made stays alive anyway (modules, the model, the tokenizer, compiled buckets); frozen objects
are still freed by reference counting when dropped, only a cycle among them is never collected.
"""

import gc


def freeze_heap() -> None:
    """Call once a process's startup (or a later warm-up that loads much) is over."""
    gc.freeze()
