"""The worker knows a request by a short per-worker handle, not by its HTTP request id: a token's frame
is a few bytes, and every message about the request (outputs, failures, aborts) still reaches its stream."""

import zmq

from xinserve.engines.core.outputs import StepOutput
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.server.pool.worker_client import READY, WorkerClient
from xinserve.server.worker import messages
from xinserve.server.worker.messages import Abort, Add, Failed, Outputs, RequestError

HTTP_ID = "chatcmpl-0123456789abcdef0123456789abcdef"  # the shape of the ids the routes make


class Socket:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, frame: bytes, flags: int = 0) -> None:
        assert flags & zmq.NOBLOCK
        self.sent.append(messages.decode_to_worker(frame))


def client_with_socket() -> tuple[WorkerClient, Socket]:
    client = WorkerClient("m", "cpu", "cpu", max_num_seqs=8, max_waiting_requests=0)
    client.state, client._send = READY, Socket()
    return client, client._send


def test_the_worker_sees_a_short_handle_and_outputs_reach_the_stream():
    client, socket = client_with_socket()
    stream = client.add(HTTP_ID, [1, 2], SamplingParams(max_tokens=4))
    other = client.add(HTTP_ID + "-2", [1], SamplingParams(max_tokens=4))
    added = socket.sent[0]
    assert isinstance(added, Add) and added.request_id == stream.handle != other.handle
    assert len(added.request_id) <= 2
    out = StepOutput(stream.handle, 0, [72])
    assert len(messages.encode(out)) <= 12  # a token's bytes in a step's frame: 53 with the HTTP id
    frame = messages.encode(Outputs([out]))
    client._dispatch(messages.decode_from_worker(frame))
    client._dispatch(Outputs([], None, {stream.handle: 0.25}))
    assert stream.queue.get_nowait() == out and other.queue.empty()
    client._dispatch(Outputs([StepOutput(stream.handle, 0, [73])], None, {stream.handle: 0.5}))
    assert stream.queue_time == 0.5


def test_failures_and_aborts_use_the_handle():
    client, socket = client_with_socket()
    stream = client.add(HTTP_ID, [1], SamplingParams(max_tokens=4, n=2))
    client.abort_choice(HTTP_ID, 1)
    client._dispatch(Failed(stream.handle, RequestError("boom")))
    assert stream.queue.get_nowait() == RequestError("boom") and client.load == 0
    again = client.add(HTTP_ID, [1], SamplingParams(max_tokens=4))  # the HTTP id is free again
    client.abort(HTTP_ID)
    assert [m.targets for m in socket.sent if isinstance(m, Abort)] == [[(stream.handle, 1)], [(again.handle, None)]]
    assert again.handle != stream.handle and HTTP_ID not in client.requests
    third = client.add(HTTP_ID, [1], SamplingParams(max_tokens=4))
    # The aborted request's last step, still on its way: never delivered to the id's new request.
    client._dispatch(Outputs([StepOutput(again.handle, 0, [65]), StepOutput(third.handle, 0, [66])]))
    assert third.queue.get_nowait().new_token_ids == [66] and third.queue.empty()
