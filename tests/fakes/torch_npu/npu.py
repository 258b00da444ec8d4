"""FAKE ``torch.npu`` graph and stream API, for tests only (the real torch_npu registers its ``npu``
module as ``torch.npu`` on import; the fake package does the same with this one).

Modelled: ``NPUGraph`` with ``torch.npu.graph(graph, pool=...)``, ``graph_pool_handle``, streams,
and the task-group update API that vllm-ascend uses to change a captured operator's host arguments
(``graph_task_group_begin`` / ``_end``, ``graph_task_update_begin`` / ``_end``).

How the fake captures: inside ``torch.npu.graph`` every aten operator that runs is recorded with its
argument and result tensors (a TorchDispatchMode). ``replay`` runs the recorded operators again on
the same tensors and copies each fresh result into the tensor the capture produced, so later
operators, which hold those tensors, read the new values: a replay computes what the captured
operators compute from the buffers' current contents, as a real graph does. Values the host read
during capture (``.numpy()``, ``.tolist()``) stay frozen in the recorded operators, as in a real
graph; only a task group's update re-records its operators with new host values.

What the fake cannot model: that a real capture does not run the operators, memory pools, and the
speed of replaying.
"""

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _Op:
    __slots__ = ("args", "func", "kwargs", "outputs")

    def __init__(self, func, args, kwargs, outputs) -> None:
        self.func, self.args, self.kwargs, self.outputs = func, args, kwargs, outputs

    def run(self) -> None:
        fresh, _ = tree_flatten(self.func(*self.args, **self.kwargs))
        for old, new in zip(self.outputs, fresh):
            # In-place and view operators return (views of) tensors the graph already holds.
            if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and new.data_ptr() != old.data_ptr():
                old.copy_(new)


class _Recorder(TorchDispatchMode):
    """Appends every operator to ``self.target`` (a graph's op list, or a task group's)."""

    def __init__(self, target: list) -> None:
        super().__init__()
        self.target = target

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        outputs, _ = tree_flatten(result)
        self.target.append(_Op(func, args, kwargs, outputs))
        return result


_capturing: "NPUGraph | None" = None  # the graph being captured
_updating: list | None = None  # the task group being re-recorded


class NPUGraph:
    def __init__(self) -> None:
        self.ops: list = []  # _Op, or ("group", handle) for a task group's ops
        self.groups: dict[int, list[_Op]] = {}
        self._recorder: _Recorder | None = None
        self.replays = 0

    def capture_begin(self, pool=None) -> None:
        global _capturing
        if _capturing is not None:
            raise RuntimeError("NPU graph capture is already under way")
        _capturing = self
        self._recorder = _Recorder(self.ops)
        self._recorder.__enter__()

    def capture_end(self) -> None:
        global _capturing
        self._recorder.__exit__(None, None, None)
        self._recorder, _capturing = None, None
        if not self.ops:
            raise RuntimeError("NPU graph capture recorded no operators")

    def replay(self) -> None:
        if _capturing is not None:
            raise RuntimeError("cannot replay a graph while capturing")
        for op in self.ops:
            if isinstance(op, tuple):
                for grouped in self.groups[op[1]]:
                    grouped.run()
            else:
                op.run()
        self.replays += 1


@contextmanager
def graph(npu_graph: NPUGraph, pool=None, stream=None):
    npu_graph.capture_begin(pool=pool)
    try:
        yield npu_graph
    finally:
        npu_graph.capture_end()


def graph_pool_handle() -> tuple:
    return (0, 0)


# ---- task groups (host arguments updated between replays) ----

def graph_task_group_begin(stream) -> None:
    """The operators launched until graph_task_group_end form one updatable task group."""
    if _capturing is None:
        raise RuntimeError("graph_task_group_begin outside a graph capture")
    handle = len(_capturing.groups)
    _capturing.groups[handle] = []
    _capturing.ops.append(("group", handle))
    _capturing._recorder.target = _capturing.groups[handle]


def graph_task_group_end(stream) -> tuple:
    if _capturing is None or _capturing._recorder.target is _capturing.ops:
        raise RuntimeError("graph_task_group_end without graph_task_group_begin")
    _capturing._recorder.target = _capturing.ops
    return (_capturing, len(_capturing.groups) - 1)


def graph_task_update_begin(stream, handle) -> None:
    """The operators launched until graph_task_update_end replace the group's (same operator, new
    host arguments)."""
    global _updating
    npu_graph, index = handle
    if _updating is not None:
        raise RuntimeError("graph_task_update_begin twice without graph_task_update_end")
    _updating = []
    npu_graph._pending = (index, _updating, _Recorder(_updating))
    npu_graph._pending[2].__enter__()
    _update_handles.append(npu_graph)


_update_handles: list[NPUGraph] = []


def graph_task_update_end(stream) -> None:
    global _updating
    if _updating is None:
        raise RuntimeError("graph_task_update_end without graph_task_update_begin")
    npu_graph = _update_handles.pop()
    index, ops, recorder = npu_graph._pending
    recorder.__exit__(None, None, None)
    if not ops:
        raise RuntimeError("a task update must launch the group's operator again")
    npu_graph.groups[index] = ops
    del npu_graph._pending
    _updating = None


# ---- streams (one queue on the CPU: ordering is trivially kept) ----

class Stream:
    def wait_stream(self, other: "Stream") -> None:
        pass

    def synchronize(self) -> None:
        pass


_default_stream = Stream()


def current_stream(device=None) -> Stream:
    return _default_stream


@contextmanager
def stream(s: Stream):
    yield s


def synchronize(device=None) -> None:
    pass


def is_available() -> bool:
    """False: the fake offers no device to other libraries (transformers asks), only to our kernels."""
    return False
