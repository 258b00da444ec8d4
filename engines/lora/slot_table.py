"""Which adapter each device slot holds, as the scheduler assigns them. No torch.

A sequence with an adapter takes a slot when it is admitted and gives it back when it is preempted or
finishes. Its adapter's slot is reused when it has one; else a free slot, else the least recently used
slot whose adapter no running sequence uses. When every slot's adapter is in use the sequence waits:
a slot is never taken from a running sequence.
"""

from collections import Counter, OrderedDict


class SlotTable:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> its slot, least recently used first
        self.users: Counter[int] = Counter()  # adapter id -> running sequences that hold its slot
        self.free = list(range(max_loras))

    def acquire(self, adapter_id: int) -> int | None:
        """A slot holding (or to hold) the adapter, counted as used by one more sequence; None: none free."""
        slot = self.slot_of.get(adapter_id)
        if slot is None:
            if self.free:
                slot = self.free.pop(0)
            else:
                victim = next((a for a in self.slot_of if not self.users[a]), None)
                if victim is None:
                    return None
                slot = self.slot_of.pop(victim)
            self.slot_of[adapter_id] = slot
        self.slot_of.move_to_end(adapter_id)
        self.users[adapter_id] += 1
        return slot

    def release(self, adapter_id: int) -> None:
        """One sequence less uses the adapter's slot (it stays assigned, for the next request of it)."""
        self.users[adapter_id] -= 1
        if not self.users[adapter_id]:
            del self.users[adapter_id]

    def forget(self, adapter_id: int) -> None:
        """The adapter is unloaded (no sequence uses it): its slot is free."""
        slot = self.slot_of.pop(adapter_id, None)
        if slot is not None:
            self.free.append(slot)

    def running(self) -> list[int]:
        """The adapters running sequences use."""
        return list(self.users)
