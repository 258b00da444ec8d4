"""The engine's loaded adapters: names, ids, the host copies kept (``max_cpu_loras``, least recently used
first among those no request uses) and the device slots (``SlotTable``). No torch: the runner reads and
holds the weights (on every rank of a tensor-parallel group), this registry says when.

An adapter removed while requests use it stays with them: new requests cannot name it, and its host copy
and slot are freed when its last sequence finishes.
"""

import hashlib
import itertools
import os
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from xinserve.engines.lora.slot_table import SlotTable

WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """One load of an adapter: ``adapter_id`` is new for every load (vLLM's lora_int_id; KV events carry
    it); ``root_hash`` starts the prefix-cache hash chain of its sequences (a hit never crosses adapters)."""

    adapter_id: int
    name: str
    path: str
    root_hash: int


def root_hash(name: str, path: str) -> int:
    """A prefix-cache root for the adapter: the same in every process for the same name and files (replicas
    agree in KV events), another one when the files change; never 0 (the base model's ROOT_HASH)."""
    try:
        stat = os.stat(os.path.join(path, WEIGHTS_FILE))
        identity = f"{stat.st_size}:{stat.st_mtime_ns}"
    except OSError:
        identity = ""
    digest = hashlib.sha256(f"lora\0{name}\0{os.path.abspath(path)}\0{identity}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1 or 1


class LoraRegistry:
    def __init__(self, runner: Any, max_loras: int, max_cpu_loras: int | None) -> None:
        """``runner``: ``load_lora(adapter_id, path)`` (ValueError when it cannot be served) and
        ``drop_lora(adapter_id)``, on every rank."""
        self.runner = runner
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.slots = SlotTable(max_loras)
        self.loaded: dict[str, AdapterRef] = {}  # name -> its current load
        self.hosted: OrderedDict[int, AdapterRef] = OrderedDict()  # host copies, least recently used first
        self.live: dict[int, AdapterRef] = {}  # seq_id -> the adapter of each unfinished sequence
        self.users: Counter[int] = Counter()  # adapter id -> its unfinished sequences
        self.removed: dict[int, AdapterRef] = {}  # adapter id -> removed while sequences still use it
        self._ids = itertools.count(1)

    @classmethod
    def of(cls, config: Any, runner: Any) -> "LoraRegistry | None":
        """An engine's registry with ``config.lora_modules`` loaded; None unless ``config.enable_lora``."""
        if not config.enable_lora:
            return None
        registry = cls(runner, config.max_loras, config.max_cpu_loras)
        for name, path in (config.lora_modules or {}).items():
            registry.add(name, path)
        return registry

    @staticmethod
    def enabled(registry: "LoraRegistry | None") -> "LoraRegistry":
        if registry is None:
            raise ValueError("LoRA adapters are not enabled on this engine (enable_lora)")
        return registry

    def add(self, name: str, path: str) -> AdapterRef:
        if not name or not isinstance(name, str):
            raise ValueError("a LoRA adapter needs a name")
        if name in self.loaded:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        ref = AdapterRef(next(self._ids), name, str(path), root_hash(name, str(path)))
        self._host(ref)
        self.loaded[name] = ref
        return ref

    def remove(self, name: str) -> None:
        ref = self.loaded.pop(name, None)
        if ref is None:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        if self._in_use(ref.adapter_id):
            self.removed[ref.adapter_id] = ref
        else:
            self._unload(ref)

    def names(self) -> list[str]:
        return list(self.loaded)

    def start(self, name: str, seqs: list[Any]) -> AdapterRef:
        """Give a new request's sequences adapter ``name`` (``seq.lora``), its host copy read again if it was
        let go; ValueError when no adapter of that name is loaded."""
        ref = self.loaded.get(name)
        if ref is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded"
                             + (f" (loaded: {', '.join(self.loaded)})" if self.loaded else ""))
        self._host(ref)
        for seq in seqs:
            seq.lora = ref
            self.live[seq.seq_id] = ref
        self.users[ref.adapter_id] += len(seqs)
        return ref

    def finished(self, seq_id: int) -> None:
        """A sequence ended (called once or more; only the first counts)."""
        ref = self.live.pop(seq_id, None)
        if ref is None:
            return
        self.users[ref.adapter_id] -= 1
        if not self.users[ref.adapter_id]:
            del self.users[ref.adapter_id]
        if ref.adapter_id in self.removed and not self._in_use(ref.adapter_id):
            self._unload(self.removed.pop(ref.adapter_id))

    def _in_use(self, adapter_id: int) -> bool:
        return adapter_id in self.users

    def _host(self, ref: AdapterRef) -> None:
        """Make sure its host copy is loaded (on every rank); let the least recently used idle ones go past
        ``max_cpu_loras``."""
        if ref.adapter_id in self.hosted:
            self.hosted.move_to_end(ref.adapter_id)
            return
        self.runner.load_lora(ref.adapter_id, ref.path)
        self.hosted[ref.adapter_id] = ref
        idle = [a for a in self.hosted if a != ref.adapter_id and not self._in_use(a)]
        for adapter_id in idle[: max(0, len(self.hosted) - self.max_cpu_loras)]:
            self.runner.drop_lora(self.hosted.pop(adapter_id).adapter_id)

    def _unload(self, ref: AdapterRef) -> None:
        if self.hosted.pop(ref.adapter_id, None) is not None:
            self.runner.drop_lora(ref.adapter_id)
        self.slots.forget(ref.adapter_id)

    def stats(self, running: list[Any], waiting: Iterable[Any]) -> dict[str, Any]:
        """EngineStats' LoRA fields (vLLM's lora_requests_info): the adapters of running and waiting sequences."""
        return {"running_lora_adapters": sorted({seq.lora.name for seq in running if seq.lora is not None}),
                "waiting_lora_adapters": sorted({seq.lora.name for seq in waiting if seq.lora is not None}),
                "max_lora": self.slots.max_loras}
