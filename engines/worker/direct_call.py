"""A compiled decode bucket called without TorchDynamo's frame and guards (CPU, engines/worker/graphs.py).

A bucket's inputs never change between steps: the same buffer views (engines/worker/decode_buckets.py), the
model's parameters and the one KV cache. So once dynamo has traced a bucket into one graph, its guards
(shapes, strides, dtypes, ids) can only pass, yet a call through dynamo still evaluates them, patches
its config and runs its frame wrapper: ~0.4 ms of CPU per step at batch 1, measured beside the graph's
own ~1.4 ms (process CPU time per ``engine.step()``, one thread). ``GraphRecorder`` is the ``torch.compile`` backend: it
compiles each graph with inductor as the default backend does and keeps the compiled graph with the
tensors dynamo handed it; ``direct_call`` rebinds those tensors from the compiler's buffers to the
step buffers and calls the compiled graph itself.

What could still change under a bound graph is the kernels (engines/worker/warmup.py swaps a layer's ``ops``
between steps); the direct call checks them by identity and otherwise returns None, and the caller
goes through dynamo, whose guards then recompile.
"""

import logging
import threading
from collections.abc import Callable

import torch

from xinserve.kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class GraphRecorder:
    """A ``torch.compile`` backend: inductor's ``compile_fx``, and a record of every graph it compiled
    on the calling thread since ``start()`` (the warm-up thread compiles; a step may recompile)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def start(self) -> None:
        self._local.graphs = []

    def taken(self) -> list[tuple[Callable, list]]:
        """(compiled graph, the tensors dynamo passed it) of each graph compiled since ``start()``."""
        return getattr(self._local, "graphs", [])

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        # Imported here: inductor costs seconds of CPU, paid in the warm-up thread after ready
        # (tests/engines/worker/test_ready_before_compile.py).
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(graph, example_inputs)
        if hasattr(self._local, "graphs"):
            self._local.graphs.append((compiled, list(example_inputs)))
        return compiled


def bucket_tensors(input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> list[torch.Tensor]:
    """A bucket's input tensors in a fixed order (the views ``DecodeBuffers.inputs`` returns)."""
    gather = metadata.decode_gather
    tensors = [input_ids, positions, metadata.slot_mapping, metadata.block_tables, metadata.seq_lens]
    if gather is not None:
        tensors += [t for t in (gather.block_ids, gather.mask, gather.host_seq_lens) if t is not None]
    return tensors


def direct_call(graph: Callable, example_inputs: list, compiler_inputs: tuple, step_inputs: tuple,
                model: torch.nn.Module | None) -> Callable[[], list[torch.Tensor] | None] | None:
    """A function running ``graph`` on the step buffers (``step_inputs``, what ``compiler_inputs`` was
    when dynamo traced it), or None when a step buffer differs in shape, strides or dtype from the
    compiler's, or an input dynamo passed is a part of the compiler's buffers other than a whole bucket
    view (it cannot be rebound; a view is matched by address, shape, strides and dtype). The function
    returns the graph's outputs, or None once a layer's kernel ops are no longer those it was traced with."""
    pairs = list(zip(bucket_tensors(*compiler_inputs), bucket_tensors(*step_inputs), strict=True))
    if any(_view_key(a)[1:] != _view_key(b)[1:] for a, b in pairs):
        logger.info("a bucket's step buffers differ from those it was compiled on; it runs through dynamo")
        return None  # dynamo's guards would recompile for them
    rebind = {_view_key(a): b for a, b in pairs}
    storages = {t.untyped_storage().data_ptr() for t in bucket_tensors(*compiler_inputs)}
    flat = []
    for tensor in example_inputs:
        key = _view_key(tensor) if isinstance(tensor, torch.Tensor) else None
        if key in rebind:
            flat.append(rebind[key])
        elif key is not None and tensor.untyped_storage().data_ptr() in storages:
            logger.info("a compiled bucket's input is a view of its buffers that cannot be rebound; "
                        "it runs through dynamo")
            return None
        else:
            flat.append(tensor)  # a parameter, a model buffer, the KV cache: the same in every step
    modules = model.modules() if model is not None else ()
    holders = [(module, module.ops) for module in modules if getattr(module, "ops", None) is not None]

    def call() -> list[torch.Tensor] | None:
        for module, ops in holders:
            if module.ops is not ops:
                return None
        return graph(*flat)

    return call


def _view_key(tensor: torch.Tensor) -> tuple:
    """What makes two tensor objects the same view of the same memory (``inputs()`` slices anew)."""
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype
