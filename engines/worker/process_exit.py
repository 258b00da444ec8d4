"""Leaving a process without walking its heap: ``leave_quickly()`` just before a process ends.

When CPython exits it tears its modules down and runs the cyclic garbage collector over every object
still alive. A worker or HTTP process has torch, transformers and sympy loaded (millions of objects),
so that walk is most of its exit: measured 1.4-1.9 CPU s per process (py-spy: ``gc_collect_main``
during finalization), on every server stop, worker restart and tensor-parallel rank. ``gc.freeze()``
moves every live object to the permanent generation, which the collector skips; objects still
reachable are freed by reference counting as before, and the memory goes back to the system when
the process ends. Only cycles left over at exit stay uncollected (their ``__del__`` does not run):
nothing of ours relies on one, and files and log handlers are flushed by the exit itself.
"""

import gc


def leave_quickly() -> None:
    """Called by a process's entry point once its work is done, right before it exits."""
    gc.freeze()
