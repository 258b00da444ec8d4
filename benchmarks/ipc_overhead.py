"""Per-token cost of getting tokens from an engine worker to the HTTP process, and of streaming them.

Measures, for batches of 1, 8 and 64 requests (one token each per step, as in decode):
  * IPC transport, ZeroMQ + msgpack (what xinserve uses: server/messages.py's msgspec structs)
    against multiprocessing.Pipe + pickle: a spawned producer sends one message per step exactly as
    ``server/worker.py`` does; the HTTP side receives, decodes and fans out to per-request asyncio
    queues through the real ``WorkerClient._dispatch``, with one consumer task per request.
  * worker-side encode time per token, and round-trip latency of a one-token message;
  * the other per-token costs of the HTTP process: incremental detokenisation and building and
    serialising an SSE chat chunk.

Prints a table and writes benchmarks/results/ipc_overhead.json. Run: python benchmarks/ipc_overhead.py
"""

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xinserve.engines.outputs import EngineStats, StepOutput
from xinserve.server import messages, responses
from xinserve.server.fanout import RequestStream
from xinserve.server.messages import Outputs
from xinserve.server.worker_client import READY, WorkerClient

STATS = EngineStats(3, 0, 0.1, 0, 10, 5, 100, 1000)


def _step_outputs(batch: int, step: int) -> list[StepOutput]:
    return [StepOutput(f"req-{i}", 0, [100 + (step + i) % 900], False, None) for i in range(batch)]


def _message(batch: int, step: int) -> Outputs:
    # As WorkerLoop._step: stats ride along now and then, queue times only on a request's first token.
    return Outputs(_step_outputs(batch, step), STATS if step % 10 == 0 else None, {})


def produce_zmq(addr: str, batch: int, steps: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(addr)
    time.sleep(0.2)  # let the connection settle before timing
    for step in range(steps):
        sock.send(messages.encode(_message(batch, step)))
    sock.close(linger=10000)
    ctx.term()


def produce_pipe(conn, batch: int, steps: int) -> None:
    time.sleep(0.2)
    for step in range(steps):
        conn.send(_message(batch, step))  # pickled by the pipe
    conn.send("done")
    conn.close()


def _client(batch: int, steps: int) -> tuple[WorkerClient, list[RequestStream]]:
    client = WorkerClient("bench", "cpu", "cpu", max_num_seqs=batch, max_waiting_requests=0)
    client.state = READY
    # Registered as add() would, without a socket.
    return client, [client.requests.open(f"req-{i}", 1) for i in range(batch)]


async def _consume(stream: RequestStream, steps: int, first: list[float] | None = None) -> None:
    await stream.queue.get()
    if first is not None:
        first.append(time.perf_counter())
    for _ in range(steps - 1):
        await stream.queue.get()


async def receive_zmq(addr: str, batch: int, steps: int) -> float:
    """The real receive path: ``WorkerClient.listen`` and its event-loop callback."""
    client, streams = _client(batch, steps)
    client.listen(addr)
    first: list[float] = []  # the clock starts at the first token, as for the pipe
    consumers = [asyncio.ensure_future(_consume(s, steps, first if i == 0 else None)) for i, s in enumerate(streams)]
    proc = mp.get_context("spawn").Process(target=produce_zmq, args=(addr, batch, steps))
    proc.start()
    await asyncio.gather(*consumers)
    elapsed = time.perf_counter() - first[0]
    proc.join()
    await client.close()
    return elapsed


async def receive_pipe(batch: int, steps: int) -> float:
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    client, streams = _client(batch, steps)
    consumers = [asyncio.ensure_future(_consume(s, steps)) for s in streams]
    proc = mp.get_context("spawn").Process(target=produce_pipe, args=(writer, batch, steps))
    proc.start()
    writer.close()
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    loop.add_reader(reader.fileno(), ready.set)
    start = None
    done = False
    while not done:
        await ready.wait()
        ready.clear()
        while reader.poll():
            message = reader.recv()
            if start is None:
                start = time.perf_counter()
            if message == "done":
                done = True
                break
            client._dispatch(message)
    loop.remove_reader(reader.fileno())
    await asyncio.gather(*consumers)
    elapsed = time.perf_counter() - start
    proc.join()
    reader.close()
    return elapsed


def encode_cost(batch: int, steps: int) -> tuple[float, float]:
    """Seconds per token to encode a step message: msgpack vs pickle."""
    outs = [_step_outputs(batch, s) for s in range(steps)]
    t0 = time.perf_counter()
    for step, o in enumerate(outs):
        messages.encode(Outputs(o, STATS if step % 10 == 0 else None, {}))
    t1 = time.perf_counter()
    for step, o in enumerate(outs):
        pickle.dumps(Outputs(o, STATS if step % 10 == 0 else None, {}))
    t2 = time.perf_counter()
    tokens = batch * steps
    return (t1 - t0) / tokens, (t2 - t1) / tokens


def echo_zmq(addr_in: str, addr_out: str, rounds: int) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(addr_in)
    push.connect(addr_out)
    for _ in range(rounds):
        push.send(pull.recv())
    push.close(linger=1000)
    pull.close()
    ctx.term()


def round_trip_zmq(tmp: str, rounds: int) -> float:
    """Median seconds for a one-token step message to go to a process and back."""
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{tmp}/rt-in")
    pull.bind(f"ipc://{tmp}/rt-out")
    proc = mp.get_context("spawn").Process(target=echo_zmq, args=(f"ipc://{tmp}/rt-in", f"ipc://{tmp}/rt-out",
                                                                    rounds + 20))
    proc.start()
    frame = messages.encode(_message(1, 1))
    samples = []
    for i in range(rounds + 20):
        t0 = time.perf_counter()
        push.send(frame)
        messages.decode_from_worker(pull.recv())
        if i >= 20:  # warm-up rounds excluded
            samples.append(time.perf_counter() - t0)
    proc.join()
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()
    return statistics.median(samples)


def echo_pipe(conn, rounds: int) -> None:
    for _ in range(rounds):
        conn.send(conn.recv())


def round_trip_pipe(rounds: int) -> float:
    here, there = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=echo_pipe, args=(there, rounds + 20))
    proc.start()
    message = _message(1, 1)
    samples = []
    for i in range(rounds + 20):
        t0 = time.perf_counter()
        here.send(message)
        here.recv()
        if i >= 20:
            samples.append(time.perf_counter() - t0)
    proc.join()
    return statistics.median(samples)


def http_side_costs(tokens: int) -> dict[str, float]:
    """Seconds per token for detokenising one token and building + serialising one SSE chunk."""
    from xinserve.engines.detokenizer import IncrementalDetokenizer
    from xinserve.server.embedded_model.tokenizer import build_tokenizer

    tok = build_tokenizer()
    text = "The morning fog rolled slowly over the harbour, and the fishing boats waited. " * 40
    ids = tok.encode(text, add_special_tokens=False)[:tokens]
    detok = IncrementalDetokenizer(tok, [0], stop=[])
    t0 = time.perf_counter()
    for t in ids:
        detok.add([t])
    t1 = time.perf_counter()
    detok_stop = IncrementalDetokenizer(tok, [0], stop=["never appears", "###"])
    for t in ids:
        detok_stop.add([t])
    t2 = time.perf_counter()
    for _ in ids:
        chunk = responses.chat_chunk("chatcmpl-0123456789abcdef", 1700000000, "xinserve-tiny",
                                     [responses.chunk_choice(0, {"content": " harbour"})], with_usage=False)
        json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
    t3 = time.perf_counter()
    n = len(ids)
    return {"detokenize": (t1 - t0) / n, "detokenize_2_stop_strings": (t2 - t1) / n, "sse_chunk_json": (t3 - t2) / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000, help="tokens per transport measurement")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ipc_overhead.json"))
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="xinserve-bench-")
    rows = []
    for batch in (1, 8, 64):
        steps = max(50, args.tokens // batch)
        zmq_s = asyncio.run(receive_zmq(f"ipc://{tmp}/b{batch}", batch, steps))
        pipe_s = asyncio.run(receive_pipe(batch, steps))
        enc_msgpack, enc_pickle = encode_cost(batch, steps)
        tokens = batch * steps
        rows.append({
            "batch": batch,
            "steps": steps,
            "zmq_msgpack_us_per_token": zmq_s / tokens * 1e6,
            "pipe_pickle_us_per_token": pipe_s / tokens * 1e6,
            "encode_msgpack_us_per_token": enc_msgpack * 1e6,
            "encode_pickle_us_per_token": enc_pickle * 1e6,
        })
    rtt = {"zmq_msgpack_us": round_trip_zmq(tmp, 500) * 1e6, "pipe_pickle_us": round_trip_pipe(500) * 1e6}
    http = {k: v * 1e6 for k, v in http_side_costs(1000).items()}

    print("Receive + decode + fan-out to per-request queues (HTTP process), microseconds per token")
    print(f"{'batch':>5}  {'zmq+msgpack':>12}  {'pipe+pickle':>12}  {'encode msgpack':>15}  {'encode pickle':>14}")
    for r in rows:
        print(f"{r['batch']:>5}  {r['zmq_msgpack_us_per_token']:>12.2f}  {r['pipe_pickle_us_per_token']:>12.2f}  "
              f"{r['encode_msgpack_us_per_token']:>15.2f}  {r['encode_pickle_us_per_token']:>14.2f}")
    print(f"round trip of a one-token step message: zmq+msgpack {rtt['zmq_msgpack_us']:.1f} us, "
          f"pipe+pickle {rtt['pipe_pickle_us']:.1f} us")
    print("other per-token costs in the HTTP process (us): " + ", ".join(f"{k} {v:.2f}" for k, v in http.items()))
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "transport": rows,
        "round_trip": rtt,
        "http_process_us_per_token": http,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
