"""Start-up's one fatal case: a config none of whose workers can load (no driver, no card, wrong
paths everywhere). The server then stops with every worker's own error instead of answering 503
forever; a config where at least one worker loads keeps serving and reports the rest on /health."""

import asyncio
import logging
from collections.abc import Callable, Iterable

from xinserve.server.pool.model_pool import ModelPool
from xinserve.server.pool.worker_client import FAILED, STARTING

logger = logging.getLogger("xinserve.server")

POLL_S = 0.25


def failure_report(pools: Iterable[ModelPool]) -> str:
    lines = ["no worker of any model could start:"]
    for pool in pools:
        for w in pool.workers:
            lines.append(f"  {pool.name}/{w.label} on {w.device}: {w.last_error or pool.error}")
    return "\n".join(lines)


async def stop_if_nothing_loads(pools: list[ModelPool], stop: Callable[[str], None]) -> None:
    """Wait until no worker is still loading; when every one has failed, call ``stop(report)``."""
    workers = [w for pool in pools for w in pool.workers]
    while any(w.state == STARTING for w in workers):
        await asyncio.sleep(POLL_S)
    if workers and all(w.state == FAILED for w in workers):
        report = failure_report(pools)
        logger.error("%s", report)
        stop(report)
