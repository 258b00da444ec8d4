"""FAKE of Moore Threads' ``torch_musa``, for tests only: the device calls xinserve makes through
``torch.musa`` (the real package sets ``torch.musa`` to itself on import), for one pretend card.

What it checks: a device is an index, ``"musa"`` / ``"musa:N"`` or None (the current card), and
names a card that exists, as the real calls refuse other devices and ordinals. What it does not do:
register the ``musa`` device type with torch (the real import renames torch's privateuse1 backend,
which cannot be undone in a process), nor set ``torch.musa`` itself; tests attach it with
``monkeypatch.setattr(torch, "musa", fake, raising=False)`` so nothing outlives a test. Memory is a
fixed pretend amount; synchronize has nothing to wait for.
"""

import torch

__version__ = "2.7.1+fake"

_DEVICE_COUNT = 1
_TOTAL_MEMORY = 48 * 2**30  # an MTT S4000's 48 GiB
_FREE_MEMORY = 40 * 2**30
_current = 0


def _index(device: int | str | torch.device | None) -> int:
    if device is None:
        return _current
    if isinstance(device, torch.device):
        device = str(device)  # a torch.device here can only be of another type: refused below
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind != "musa":
            raise ValueError(f"Expected a musa device, but got: {device}")
        device = int(index or _current)
    if not 0 <= device < _DEVICE_COUNT:
        raise RuntimeError(f"MUSA error: invalid device ordinal {device} (device_count() is {_DEVICE_COUNT})")
    return device


def is_available() -> bool:
    return True


def device_count() -> int:
    return _DEVICE_COUNT


def current_device() -> int:
    return _current


def set_device(device: int | str | torch.device) -> None:
    global _current
    _current = _index(device)


def mem_get_info(device: int | str | torch.device | None = None) -> tuple[int, int]:
    """(free, total) bytes of the card."""
    _index(device)
    return _FREE_MEMORY, _TOTAL_MEMORY


def synchronize(device: int | str | torch.device | None = None) -> None:
    _index(device)
