"""WorkerLoras: each load / unload call gets the worker's answer to its own message (by number), the
adapters it holds follow the answers, and a call whose worker goes away ends as unavailable."""

import asyncio

from xinserve.server.pool.worker_loras import WorkerLoras
from xinserve.server.worker import messages
from xinserve.server.worker.messages import LoadLora, LoraDone, RequestError, UnloadLora


class Wire:
    """What the worker was sent, as decoded from the wire; ``accepting`` False: the worker is not ready."""

    def __init__(self, accepting: bool = True) -> None:
        self.sent: list = []
        self.accepting = accepting

    def post(self, message) -> bool:
        if self.accepting:
            self.sent.append(messages.decode_to_worker(messages.encode(message)))
        return self.accepting


def test_answers_reach_their_own_calls_in_any_order():
    async def main():
        wire = Wire()
        loras = WorkerLoras(wire.post, "cpu")
        first = asyncio.ensure_future(loras.load("sql", "/sql"))
        second = asyncio.ensure_future(loras.unload("chat"))
        await asyncio.sleep(0)
        load, unload = wire.sent
        assert (type(load), load.name, load.path) == (LoadLora, "sql", "/sql")
        assert (type(unload), unload.name) == (UnloadLora, "chat")
        refusal = RequestError("rank 64 is more than max_lora_rank 16", client_fault=True)
        loras.done(messages.decode_from_worker(messages.encode(LoraDone(unload.op, None, ["x"]))))
        loras.done(messages.decode_from_worker(messages.encode(LoraDone(load.op, refusal, ["x"]))))
        assert await second is None
        assert await first == refusal and refusal.status == 400
        assert loras.names == {"x"}
        assert loras._pending == {}

    asyncio.run(main())


def test_a_worker_not_taking_messages_is_unavailable_at_once():
    async def main():
        loras = WorkerLoras(Wire(accepting=False).post, "cpu#1")
        error = await loras.load("sql", "/sql")
        assert error.unavailable and error.status == 503 and "cpu#1" in error.message
        assert loras._pending == {}

    asyncio.run(main())


def test_a_worker_that_dies_ends_its_pending_calls():
    async def main():
        loras = WorkerLoras(Wire().post, "cpu")
        loras.started(["sql"])
        call = asyncio.ensure_future(loras.unload("sql"))
        await asyncio.sleep(0)
        loras.fail_pending("worker cpu of m died")
        error = await call
        assert (error.status, error.message) == (503, "worker cpu of m died")
        assert loras.names == set()  # a new process reports its own at ready
        loras.done(LoraDone(99, None, ["late"]))  # an answer nobody waits for: only the names move
        assert loras.names == {"late"}

    asyncio.run(main())
