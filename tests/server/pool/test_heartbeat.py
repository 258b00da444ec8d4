"""WorkerClient's heartbeat watch, in-process: silence -> unresponsive (its requests moved or ended)
-> killed; a message in between makes the worker ready again. And the worker loop's side: an idle
loop beats at the period the server asks for.

No process is spawned: the client's clock of the worker's last message is moved back instead, and
the process is a stand-in that records the kill. tests/server/pool/test_hung_worker.py does it for real.
"""

import asyncio
import threading
import time

import zmq

from xinserve.engines.core.outputs import EngineStats
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.server.pool import heartbeat
from xinserve.server.pool.worker_client import READY, UNRESPONSIVE, WorkerClient
from xinserve.server.worker.engine_worker import WorkerLoop
from xinserve.server.worker.messages import Outputs, RequestError, Shutdown, Stats, decode_from_worker, encode

TIMEOUT = 2.0


class Process:
    pid = 4242

    def __init__(self) -> None:
        self.kills = 0

    def kill(self) -> None:
        self.kills += 1


def serving_client(*request_ids: str) -> tuple[WorkerClient, Process]:
    client = WorkerClient("m", "cpu#1", "cpu", max_num_seqs=4, max_waiting_requests=0, heartbeat_timeout_s=TIMEOUT)
    client.state = READY
    client._proc = proc = Process()
    for request_id in request_ids:
        client.requests.open(request_id, 1)  # as add() registers them
    client.last_message_at = time.monotonic()
    return client, proc


def silent_for(client: WorkerClient, seconds: float) -> None:
    client.last_message_at = time.monotonic() - seconds


def test_verdicts():
    assert heartbeat.verdict(1.9, TIMEOUT) == heartbeat.OK
    assert heartbeat.verdict(2.0, TIMEOUT) == heartbeat.SILENT
    assert heartbeat.verdict(4.0, TIMEOUT) == heartbeat.HUNG
    assert heartbeat.tick_s(TIMEOUT) == 0.5 and heartbeat.tick_s(60) == 1.0


def test_silence_makes_the_worker_unresponsive_and_its_requests_retryable():
    client, proc = serving_client("a", "b")
    streams = dict(client.requests._streams)
    silent_for(client, TIMEOUT - 0.5)
    client._check_heartbeat()
    assert client.state == READY and client.load == 2
    silent_for(client, TIMEOUT + 0.1)
    client._check_heartbeat()
    assert client.state == UNRESPONSIVE and not client.ready
    assert client.load == 0 and not client.requests._streams
    for stream in streams.values():
        error = stream.queue.get_nowait()
        assert isinstance(error, RequestError) and error.retryable and error.status == 503
        assert "unresponsive" in error.message
    assert "no message for" in client.last_error
    assert proc.kills == 0
    assert client.describe()["state"] == "unresponsive"
    # New requests are not sent to it: they fail at once, retryable, and leave no load.
    stream = client.add("c", [1, 2], SamplingParams(max_tokens=4))
    assert stream.queue.get_nowait().retryable and client.load == 0


def test_a_worker_that_speaks_again_is_ready_again():
    client, proc = serving_client()
    silent_for(client, TIMEOUT + 0.1)
    client._check_heartbeat()
    assert client.state == UNRESPONSIVE
    client._dispatch(Outputs([]))
    assert client.state == READY
    client._check_heartbeat()
    assert client.state == READY and proc.kills == 0


def test_a_long_silence_kills_the_worker_once():
    client, proc = serving_client("a")
    stream = client.requests._streams["a"]
    silent_for(client, 2 * TIMEOUT + 0.1)  # e.g. the event loop itself was held up past both deadlines
    client._check_heartbeat()
    assert proc.kills == 1 and client.state == UNRESPONSIVE
    assert stream.queue.get_nowait().retryable
    client._check_heartbeat()
    client._dispatch(Outputs([]))  # a last word before the kill lands: still going
    assert proc.kills == 1 and client.state == UNRESPONSIVE


def test_the_watch_checks_on_its_own():
    async def go():
        client, _ = serving_client("a")
        client._watchdog = asyncio.ensure_future(client._watch_heartbeat())
        silent_for(client, TIMEOUT + 0.1)
        await asyncio.sleep(heartbeat.tick_s(TIMEOUT) + 0.2)
        state = client.state
        client._watchdog.cancel()
        return state

    assert asyncio.run(go()) == UNRESPONSIVE


class IdleEngine:
    def has_unfinished_requests(self) -> bool:
        return False

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)


def test_an_idle_worker_loop_beats_at_the_servers_period():
    ctx = zmq.Context()
    to_worker, from_worker = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_worker.bind("inproc://beat-in")
    from_worker.bind("inproc://beat-out")
    recv, send = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    recv.connect("inproc://beat-in")
    send.connect("inproc://beat-out")
    loop = WorkerLoop(IdleEngine(), recv, send, "test", heartbeat_s=heartbeat.tick_s(0.2))  # every 50 ms
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        beats, deadline = 0, time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if from_worker.poll(100) and isinstance(decode_from_worker(from_worker.recv()), Stats):
                beats += 1
        assert beats >= 8  # about 20 at 50 ms; the default period (1 s) would give one or two
    finally:
        to_worker.send(encode(Shutdown()))
        thread.join(5)
        for s in (to_worker, from_worker, recv, send):
            s.close(linger=0)
        ctx.term()
