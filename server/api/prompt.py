"""Route a request and tokenise its prompt, the tokenising in a thread off the event loop.

Templating and tokenising a long prompt take long enough to stall every other stream if run on
the loop. The prompt is tokenised with the pool's tokenizer before the worker is picked, because
picking and starting must not be split by an await: the pick reads each worker's load, which only
grows when the request starts, so requests that awaited in between would all pick the same one.
"""

import asyncio
from collections.abc import Callable
from typing import TypeVar

from xinserve.server.pool.model_pool import ModelPool
from xinserve.server.pool.router import Router, Target
from xinserve.server.pool.worker_client import WorkerClient

T = TypeVar("T")


async def route_encoded(
    router: Router, target: Target, n: int, encode: Callable[[ModelPool], T], *, may_use: Callable[[str], bool]
) -> tuple[ModelPool, WorkerClient, T]:
    """``(pool, worker, encode(pool))``, ``encode`` run in a thread; the router's errors as they are.

    ``target``: what the request's model names (``Router.resolve``). ``may_use``: the models the
    request's key may use (``functools.partial(server.auth.may_use, request)``); required, so that no
    route can reach a fallback the key may not use by forgetting it.
    """
    # The pool the router would pick from, found without picking (a pick moves its round-robin
    # turn); when none is ready, ``route`` raises its own 503.
    pool = (next((p for p in router.pools_for(target, may_use) if router.serving(p, target.lora_name)), None)
            or router.route(target, n, may_use)[0])
    while True:
        encoded = await asyncio.to_thread(encode, pool)
        routed, worker = router.route(target, n, may_use)
        if routed is pool:
            return pool, worker, encoded
        pool = routed  # a pool went up or down meanwhile: another tokenizer may now apply
