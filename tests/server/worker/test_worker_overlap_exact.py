"""With the overlap on (outputs sent by the worker's sender thread, merged while the HTTP side lags),
greedy tokens still equal transformers' token for token: under batching and preemption, with n-gram
speculative rows, and beside a request aborted mid-way, whose tokens are a prefix of its reference.

A real engine on the tiny Llama runs in ``WorkerLoop`` over in-process sockets, driven by the HTTP
process's ``WorkerClient`` (requests known to the worker by handles); the reading end takes nothing
until the engine is done (high-water marks of one frame), so most steps' outputs go out merged, and
every token must still reach its request's stream once, in order, with its finish reason.
"""

import random
import threading
import time

import pytest
import torch
import zmq
from transformers import AutoModelForCausalLM

from xinserve.engines import LLM, SamplingParams
from xinserve.engines.core.scheduler import num_pending
from xinserve.server.pool.worker_client import READY, WorkerClient
from xinserve.server.worker import messages
from xinserve.server.worker.engine_worker import WorkerLoop
from xinserve.server.worker.messages import Abort, Shutdown

MAX_TOKENS = 10
LONG = 40  # the aborted request's budget
TIMEOUT_S = 120


def reference(path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, top_p=None,
                               top_k=None, temperature=None)[0, len(p):].tolist() for p, n in zip(prompts, max_tokens)]


def wait_for(pred, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3}], ids=["plain", "ngram"])
def test_greedy_equals_transformers_with_outputs_merged(tiny_model_dir, speculative):
    rng = random.Random(7)
    # Repeating prompts give the n-gram proposer drafts to verify.
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(4, 9))] * 2 for _ in range(8)]
    llm = LLM(tiny_model_dir, num_kv_blocks=24, block_size=4, enable_prefix_caching=False,
              speculative_config=speculative)
    ctx = zmq.Context()
    to_worker, recv = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    send, from_worker = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    send.setsockopt(zmq.SNDHWM, 1)
    from_worker.setsockopt(zmq.RCVHWM, 1)
    to_worker.bind("inproc://exact-in")
    recv.connect("inproc://exact-in")
    from_worker.bind("inproc://exact-out")
    send.connect("inproc://exact-out")
    loop = WorkerLoop(llm.engine, recv, send, "test", heartbeat_s=60)  # no idle heartbeat while draining
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    client = WorkerClient("m", "cpu", "cpu", max_num_seqs=16, max_waiting_requests=16)
    client.state, client._send = READY, to_worker
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    try:
        streams = [client.add(f"chatcmpl-{i}", prompt, greedy) for i, prompt in enumerate(prompts)]
        long = client.add("chatcmpl-long", prompts[0], SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True))
        seqs = llm.engine.requests
        # Known tokens: with async scheduling the last one may still be pending (a placeholder).
        wait_for(lambda: long.handle in seqs and seqs[long.handle][0].num_output_tokens - num_pending(
            seqs[long.handle][0]) >= 3, "it never ran")
        # Aborted in the worker, its stream kept here: what it produced before the abort still arrives.
        to_worker.send(messages.encode(Abort([(long.handle, None)])))
        wait_for(lambda: not llm.engine.has_unfinished_requests(), "the requests never finished")
        while from_worker.poll(1000):
            client._dispatch(messages.decode_from_worker(from_worker.recv()))
    finally:
        to_worker.send(messages.encode(Shutdown()))
        thread.join(TIMEOUT_S)
        for s in (to_worker, recv, send, from_worker):
            s.close(linger=0)
        ctx.term()
    got, reasons = [], []
    for stream in [*streams, long]:
        outs = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
        got.append([t for out in outs for t in out.new_token_ids])
        reasons.append([out.finish_reason for out in outs if out.finished])
    assert loop.sender.merged > 0
    # Async scheduling ran steps ahead of their tokens (speculative decoding steps one at a time).
    assert (loop.async_steps is None) == (speculative is not None)
    assert speculative is not None or loop.async_steps.overlapped > 0
    assert llm.engine.stats().num_preemptions_total > 0
    *expected, long_expected = reference(tiny_model_dir, [*prompts, prompts[0]], [MAX_TOKENS] * len(prompts) + [LONG])
    for i, tokens in enumerate(expected):
        assert got[i] == tokens, f"prompt {i} diverged"
        assert reasons[i] == ["length" if len(tokens) == MAX_TOKENS else "stop"]
    assert 3 <= len(got[-1]) < LONG and got[-1] == long_expected[: len(got[-1])] and reasons[-1] == []
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # the abort leaked no block
