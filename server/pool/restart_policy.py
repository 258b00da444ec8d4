"""How long a dead worker waits before it is started again: exponential backoff with a reset.

1 s, 2 s, 4 s ... capped at 60 s, so a worker that crashes on every start costs one spawn a minute
instead of a hot loop; a worker that stayed healthy for 5 minutes starts again from 1 s, so an
occasional crash in a long-running fleet is always retried quickly. Pure: the caller passes the
healthy time in, which keeps it testable without clocks.
"""

from dataclasses import dataclass


@dataclass(slots=True)
class RestartBackoff:
    first_s: float = 1.0
    cap_s: float = 60.0
    reset_after_s: float = 300.0
    streak: int = 0  # restarts since the worker last stayed healthy for ``reset_after_s``

    def next_delay(self, healthy_for_s: float) -> float:
        """Seconds to wait before the next start of a worker that was ready ``healthy_for_s`` (0 if never)."""
        if healthy_for_s >= self.reset_after_s:
            self.streak = 0
        delay = min(self.cap_s, self.first_s * 2**self.streak)
        if delay < self.cap_s:  # stop counting at the cap: 2**streak would grow without bound
            self.streak += 1
        return delay
