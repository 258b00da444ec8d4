"""Fake workers and pools for the router's tests: load, capacity and readiness, nothing else."""

from types import SimpleNamespace

from xinserve.server.config import ModelSettings
from xinserve.server.pool.router import Router


class Worker:
    def __init__(self, label: str, ready: bool = True, load: int = 0, capacity: int = 4,
                 loras: tuple[str, ...] = ()) -> None:
        self.label, self.ready, self.load, self.capacity = label, ready, load, capacity
        self.loras = SimpleNamespace(names=set(loras))  # the LoRA adapters it holds (WorkerLoras.names)

    def has_capacity(self, n: int) -> bool:
        return self.load + n <= self.capacity


class Pool:
    def __init__(self, name: str, workers: list[Worker], fallback: list[str] | None = None,
                 adapters: dict[str, str] | None = None) -> None:
        self.settings = ModelSettings(name=name, path="/m", fallback=fallback or [], enable_lora=bool(adapters))
        self.name = name
        self.workers = workers
        self.adapters = dict(adapters or {})  # LoRA adapter name -> directory

    def ready_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.ready]


def router(*pools: Pool) -> Router:
    return Router({p.name: p for p in pools})


def any_model(name: str) -> bool:
    """``may_use`` for a request whose key may use every model."""
    return True
