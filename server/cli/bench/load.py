"""One load level: closed loop (at most ``concurrency`` requests in flight) or open loop (Poisson
arrivals at ``request_rate`` per second, optionally also capped by ``concurrency``)."""

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from tqdm import tqdm

from xinserve.server.cli.bench.client import RequestResult

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Level:
    concurrency: int | None  # None: no cap (open loop only)
    request_rate: float  # requests per second; math.inf: all at once (closed loop)

    @property
    def label(self) -> str:
        parts = []
        if self.concurrency is not None:
            parts.append(f"c={self.concurrency}")
        if not math.isinf(self.request_rate):
            parts.append(f"{self.request_rate:g} req/s")
        return " ".join(parts)


def levels(concurrencies: list[int] | None, rates: list[float] | None) -> list[Level]:
    """Every concurrency with every rate; closed loop at concurrency 8 when neither is given."""
    if not concurrencies and not rates:
        concurrencies = [8]
    return [Level(c, r) for c in (concurrencies or [None]) for r in (rates or [math.inf])]


async def run_level(
    send: Callable[[T], Awaitable[RequestResult]], requests: list[T], level: Level, seed: int,
) -> tuple[list[RequestResult], float]:
    """``send`` every request at ``level``; the results in request order and the wall time taken."""
    limit = asyncio.Semaphore(level.concurrency) if level.concurrency is not None else None
    rng = random.Random(seed)
    # tqdm hides itself when stderr is not a terminal (disable=None), so logs and CI stay clean.
    progress = tqdm(total=len(requests), desc=level.label, unit="req", leave=False, disable=None)

    async def one(request: T) -> RequestResult:
        if limit is None:
            result = await send(request)
        else:
            async with limit:
                result = await send(request)
        progress.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.ensure_future(one(request)))
        if not math.isinf(level.request_rate):
            await asyncio.sleep(rng.expovariate(level.request_rate))
    try:
        results = list(await asyncio.gather(*tasks))
    finally:
        progress.close()
    return results, time.perf_counter() - start
