"""Test doubles for the compile child (engines/compile/child_process.py ``CompileChild``) and the artifact
loader (engines/compile/artifacts.py ``load``), so that tests decide when a bucket "compiles" (no child,
no inductor): each loaded step is ``decode_step`` itself, run eagerly on the bucket's static buffers (the
padding, the row layout and the max_model_len-wide plans of a compiled step), which makes outputs
comparable token for token."""

import threading
import time
from typing import ClassVar

import xinserve.engines.worker.warmup
from xinserve.engines.compile.decode_step import decode_step

TIMEOUT_S = 60


class EagerStep:
    """What ``artifacts.load`` returns, standing in: the eager step."""

    def __call__(self, *args):
        return decode_step(*args)

    def disable_guard_check(self) -> None:
        pass


class BlockingChild:
    """Stands in for ``CompileChild``: reports each bucket of its spec's order as compiling, waits for
    ``release``, then reports it compiled (or failed, for the buckets in ``failing``)."""

    instances: ClassVar[list["BlockingChild"]] = []
    failing: ClassVar[set[int]] = set()
    released: ClassVar[bool] = False  # True: never wait

    def __init__(self, spec, directory) -> None:
        self.spec = spec
        self.calls: list[int] = []
        self.started = threading.Event()
        self.release = threading.Event()
        if self.released:
            self.release.set()
        BlockingChild.instances.append(self)

    @classmethod
    def latest(cls) -> "BlockingChild":
        """The last child started (the warm-up thread starts it soon after the engine is built)."""
        deadline = time.monotonic() + TIMEOUT_S
        while not cls.instances:
            assert time.monotonic() < deadline, "no compile child started"
            time.sleep(0.01)
        return cls.instances[-1]

    def wait_compiling(self, warmup) -> None:
        """Until the warm-up has taken this child's first "compiling" event (it reads events on a thread)."""
        assert self.started.wait(TIMEOUT_S)
        deadline = time.monotonic() + TIMEOUT_S
        while "compiling" not in {b["state"] for b in warmup.report()["buckets"].values()}:
            assert time.monotonic() < deadline, "no bucket compiling"
            time.sleep(0.01)

    def events(self):
        for size in self.spec.order:
            self.calls.append(size)
            yield {"bucket": size, "event": "compiling"}
            self.started.set()
            assert self.release.wait(TIMEOUT_S)
            if size in self.failing:
                yield {"bucket": size, "event": "done", "state": "failed",
                       "error": f"RuntimeError: inductor broke on bucket {size}"}
            else:
                yield {"bucket": size, "event": "done", "state": "compiled", "error": None}

    def finish(self) -> None:
        return None

    def stop(self) -> None:
        self.release.set()


def use_doubles(monkeypatch, released: bool) -> type[BlockingChild]:
    """Every engine built from now on compiles through ``BlockingChild`` and loads ``EagerStep``s; nothing is
    read from or written to the bucket cache (a test's buckets are never found on disk)."""
    warmup = xinserve.engines.worker.warmup
    monkeypatch.setattr(warmup, "CompileChild", BlockingChild)
    monkeypatch.setattr(warmup.artifacts, "load", lambda directory, size: EagerStep())
    monkeypatch.setattr(warmup.artifacts, "read_manifest", lambda directory: {})
    BlockingChild.instances.clear()
    monkeypatch.setattr(BlockingChild, "failing", set())
    monkeypatch.setattr(BlockingChild, "released", released)
    return BlockingChild
