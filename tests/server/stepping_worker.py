"""A stand-in for an engine worker in the HTTP process, for tests of the HTTP path alone.

``step()`` hands one token to every open request through the real ``Fanout``, as one worker
``Outputs`` message would (``length`` at its max_tokens). Used by test_stream_path_calls.py (a step
once every stream took the last one) and test_stream_push_flow_control.py (a step from a loop callback).
"""

from xinserve.engines.core.outputs import StepOutput
from xinserve.server.pool.fanout import Fanout, RequestStream


class SteppingWorker:
    model_name, label, ready, capacity, stats, restarts = "m", "cpu", True, 1024, None, 0

    def __init__(self, vocab_size: int, tokens: list[int]) -> None:
        self.info = {"vocab_size": vocab_size, "max_model_len": 4096}
        self.tokens = tokens  # the text, cycled
        self.fanout = Fanout(lambda message: True)
        self.open: dict[str, list] = {}  # handle -> [tokens sent, max_tokens, stream]

    @property
    def load(self) -> int:
        return self.fanout.load

    def has_capacity(self, n: int) -> bool:
        return True

    def add(self, request_id, prompt_token_ids, params) -> RequestStream:
        stream = self.fanout.open(request_id, params.n)
        self.open[stream.handle] = [0, params.max_tokens, stream]
        return stream

    def abort(self, request_id: str) -> None:
        self.fanout.abort(request_id)

    def abort_choice(self, request_id: str, index: int, emitted: int | None = None) -> None:
        self.fanout.abort_choice(request_id, index, emitted)

    def step(self) -> None:
        outputs = []
        for handle, state in list(self.open.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outputs.append(StepOutput(handle, 0, [self.tokens[state[0] % len(self.tokens)]], done,
                                      "length" if done else None))
            if done:
                del self.open[handle]
        self.fanout.deliver(outputs, {})
