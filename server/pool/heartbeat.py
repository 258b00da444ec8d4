"""Is a serving worker alive? Its silence, measured against ``server.heartbeat_timeout_s``.

A worker's step loop itself speaks (server/worker/engine_worker.py): one OUTPUTS message after every step and,
while idle, a STATS message every ``tick_s``. No side thread beats for it, because a thread
would go on beating while the loop is wedged, so silence means the loop makes no progress: the
process is stopped (SIGSTOP), stuck in a driver call, or rank 0 of a tensor-parallel group waits in
a collective that a stuck rank never joins. A busy worker is never silent: each step is a message.

The HTTP process checks as often: after ``timeout_s`` of silence the worker is
unresponsive (no new requests; its requests fail, and those without a token are retried on
another worker), after as long again it is hung and killed with SIGKILL (a stopped process never
sees SIGTERM), then restarted with the usual backoff. A message in between makes it ready again.
The deadline applies from the worker's READY on: loading and compiling the decode buckets happen
before, where a model may take minutes; they are watched by the process's exit instead.
"""

OK, SILENT, HUNG = "ok", "silent", "hung"


def tick_s(timeout_s: float) -> float:
    """How often an idle worker speaks, and how often the HTTP process looks at its silence: four
    times per timeout, at most once a second."""
    return min(1.0, timeout_s / 4)


def verdict(silence_s: float, timeout_s: float) -> str:
    """OK, SILENT (unresponsive: routed around) or HUNG (to be killed) after ``silence_s`` seconds."""
    if silence_s >= 2 * timeout_s:
        return HUNG
    return SILENT if silence_s >= timeout_s else OK
