"""CPU per streamed token of the HTTP process's own Python path, in process: no sockets, no server.

The real app (``create_app``: middleware, routes, generation, detokenisation, frames, metrics) is
called as an ASGI app by this script, with ``--concurrency`` streamed chat requests at once; one
stand-in worker step after another hands one token to every open request through the real
``Fanout`` (as a worker's ``Outputs`` message would), once every stream has taken the previous
one. What uvicorn and the kernel add per write (http_stream_cpu.py measures the whole process) is
left out, so the figure is the thread CPU time (``time.thread_time``, steady under load) of our
code per token. Arms are checkouts run in turn in subprocesses, alternating order per repeat.

Run: python benchmarks/stream_path_cpu.py [--before /work/main] [--concurrency 8,32] [--repeats 5]
Writes benchmarks/results/stream_path_cpu.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = "the quick brown fox jumps over a lazy dog while seven happy cats watch from the old red barn"


def measure(tokenizer_dir: str, concurrency: int, output_tokens: int, requests: int) -> tuple[float, float]:
    """(thread CPU microseconds, Python function calls) per streamed token, run with the arm's checkout
    first on sys.path. The calls (counted by cProfile, in a second run) do not vary with the load."""
    sys.path.append(str(Path(__file__).resolve().parent))  # stepping_worker.py, beside this file
    import asyncio
    import cProfile
    import pstats
    import time

    from stepping_worker import SteppingWorker
    from transformers import AutoTokenizer

    from xinserve.server.app import create_app
    from xinserve.server.config import parse_config
    from xinserve.server.responses import TokenTexts

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = [t for w in TEXT.split() for t in tok.encode(" " + w, add_special_tokens=False)]

    class Worker(SteppingWorker):
        async def run(self, until: asyncio.Future) -> None:
            while not until.done():
                # One turn of the loop runs every stream woken by the last step; none open (requests
                # being tokenised in a thread): wait without spinning on this thread's CPU.
                await asyncio.sleep(0 if self.open else 0.001)
                if all(state[2].queue.empty() for state in self.open.values()):
                    self.step()  # every stream took its last token

    app = create_app(parse_config({"models": [{"name": "m", "path": tokenizer_dir, "workers": ["cpu"]}]}))
    pool = app.state.router.pools["m"]
    worker = Worker(len(tok), tokens)
    pool.tokenizer, pool.token_texts, pool.workers = tok, TokenTexts(tok), [worker]
    raw = json.dumps({"model": "m", "stream": True, "max_tokens": output_tokens,
                      "messages": [{"role": "user", "content": "hello there"}]}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("bench", 80)}
    written = [0]

    async def one() -> None:
        sent = [False]

        async def receive() -> dict:
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()
            return {}

        async def send(message: dict) -> None:
            written[0] += len(message.get("body", b""))

        await app({**scope, "headers": list(scope["headers"])}, receive, send)

    async def level(n: int) -> None:
        sem = asyncio.Semaphore(concurrency)
        until = asyncio.get_running_loop().create_future()
        stepper = asyncio.ensure_future(worker.run(until))

        async def limited() -> None:
            async with sem:
                await one()

        await asyncio.gather(*(limited() for _ in range(n)))
        until.set_result(None)
        await stepper

    asyncio.run(level(concurrency))  # first-call costs out
    start = time.thread_time()
    asyncio.run(level(requests))
    us = (time.thread_time() - start) / (requests * output_tokens) * 1e6
    profile = cProfile.Profile()
    profile.runcall(asyncio.run, level(requests))
    calls = pstats.Stats(profile).total_calls
    return us, calls / (requests * output_tokens)


def _run_arm(root: Path, tokenizer_dir: Path, concurrency: int, output_tokens: int, requests: int) -> list[float]:
    code = (f"import sys; sys.path.insert(0, {str(root)!r}); sys.path.insert(1, {str(ROOT / 'benchmarks')!r}); "
            f"import stream_path_cpu as b; "
            f"print(b.measure({str(tokenizer_dir)!r}, {concurrency}, {output_tokens}, {requests}))")
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1].replace("(", "[").replace(")", "]"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, help="an older checkout: the first arm")
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests-per-stream", type=int, default=4, help="requests per level: this x concurrency")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stream_path_cpu.json")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from xinserve.server.bench.cli import machine
    from xinserve.server.embedded_model.factory import ensure_tiny_model

    arms = [("after", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    runs: dict[str, dict[str, list[list[float]]]] = {label: {} for label, _ in arms}
    with tempfile.TemporaryDirectory(prefix="xinserve-stream-cpu-") as tmp:
        model = ensure_tiny_model(Path(tmp), "llama-h256-l4", hidden_size=256, num_layers=4, num_heads=4,
                                  num_kv_heads=2)
        for rep in range(args.repeats):
            for conc in map(int, args.concurrency.split(",")):
                for label, root in arms if rep % 2 == 0 else reversed(arms):
                    us, calls = _run_arm(root, model, conc, args.output_tokens, args.requests_per_stream * conc)
                    runs[label].setdefault(f"c={conc}", []).append([us, calls])
                    print(f"rep {rep} c={conc:<3} {label:<7} {us:7.1f} us thread CPU, {calls:6.1f} Python calls "
                          f"per token", flush=True)
    summary = {level: {label: {"us_per_token": statistics.median(r[0] for r in runs[label][level]),
                               "calls_per_token": statistics.median(r[1] for r in runs[label][level])}
                       for label in runs} for level in runs["after"]}
    print(f"{'level':<8}" + "".join(f"{label + ' us/token':>18}{'calls/token':>13}" for label in runs))
    for level, row in summary.items():
        print(f"{level:<8}" + "".join(f"{row[label]['us_per_token']:>18.1f}{row[label]['calls_per_token']:>13.1f}"
                                      for label in runs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine(), "load_average": os.getloadavg(), "output_tokens": args.output_tokens,
        "arms": {label: str(root) for label, root in arms}, "runs": runs, "summary_median": summary},
        indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
