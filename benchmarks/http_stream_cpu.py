"""CPU seconds per streamed token of the HTTP process alone, with a scripted worker: no model, no noise.

The served app is the real one (``create_app``: middleware, routes, generation, SSE), run by uvicorn
in a process of its own from an arm's checkout, but its one worker is a stand-in in that process:
every ``--step-ms`` it hands one token to every open request through the real ``Fanout``, as a
worker's ``Outputs`` message would. The load is streamed chat requests from this process (httpx).
Per arm: user + system CPU of the server process (/proc/PID/stat) over a level's requests, divided by
the tokens streamed. Arms alternate order per repeat. An arm may hide packages from its server (a
stub module that fails to import), to measure a checkout as it ran before they were installed.

Run: python benchmarks/http_stream_cpu.py [--before /work/main --before-without httptools,uvloop]
Writes benchmarks/results/http_stream_cpu.json.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TICK_S = 1 / os.sysconf("SC_CLK_TCK")
TEXT = "the quick brown fox jumps over a lazy dog while seven happy cats watch from the old red barn"


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def serve(port: int, tokenizer_dir: str, step_ms: float) -> None:
    """The server side (run in a subprocess whose sys.path starts with the arm's checkout)."""
    sys.path.append(str(Path(__file__).resolve().parent))  # stepping_worker.py, beside this file
    import uvicorn
    from stepping_worker import SteppingWorker
    from transformers import AutoTokenizer

    from xinserve.server.app import create_app
    from xinserve.server.config import parse_config
    from xinserve.server.responses import TokenTexts

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = [t for w in TEXT.split() for t in tok.encode(" " + w, add_special_tokens=False)]

    class Worker(SteppingWorker):
        """A step every ``step_ms``, from the first request on."""

        task: asyncio.Task | None = None

        def add(self, request_id, prompt_token_ids, params):
            if self.task is None:
                self.task = asyncio.get_running_loop().create_task(self._run())
            return super().add(request_id, prompt_token_ids, params)

        async def _run(self) -> None:
            while True:
                await asyncio.sleep(step_ms / 1000)
                self.step()

    app = create_app(parse_config({"models": [{"name": "m", "path": tokenizer_dir, "workers": ["cpu"]}]}))
    pool = app.state.router.pools["m"]
    pool.tokenizer, pool.token_texts, pool.workers = tok, TokenTexts(tok), [Worker(len(tok), tokens)]
    # No lifespan: it would spawn real workers. The uvicorn protocol and loop are uvicorn's own choice
    # ("auto"), as `xinserve serve` leaves them unless it says otherwise.
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning",
                            access_log=False)
    print(f"serving with {config.http} / {config.loop}", flush=True)
    uvicorn.Server(config).run()


async def _one(client: httpx.AsyncClient, url: str, max_tokens: int) -> int:
    body = {"model": "m", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello there"}]}
    chunks = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            chunks += line.startswith("data: {")
    return chunks


async def _load(url: str, concurrency: int, requests: int, max_tokens: int) -> int:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def run() -> int:
            async with sem:
                return await _one(client, url, max_tokens)

        return sum(await asyncio.gather(*(run() for _ in range(requests))))


def _start(root: Path, without: list[str], extra: list[str], port: int, tokenizer_dir: Path, step_ms: float,
           scratch: Path):
    paths = [str(root), *extra]
    if without:  # stubs that fail to import, first on the path: uvicorn's "auto" falls back
        stubs = scratch / f"without-{port}"
        stubs.mkdir()
        for name in without:
            (stubs / f"{name}.py").write_text(f"raise ImportError('{name} hidden by the benchmark')\n")
        paths.insert(0, str(stubs))
    code = (f"import sys, importlib.util; sys.path[:0] = {paths!r}; "
            f"spec = importlib.util.spec_from_file_location('bench', {str(Path(__file__).resolve())!r}); "
            f"bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench); "
            f"bench.serve({port}, {str(tokenizer_dir)!r}, {step_ms})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    with open(scratch / f"server-{port}.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((scratch / f"server-{port}.log").read_text()[-3000:])
        try:
            httpx.get(f"{url}/v1/models", timeout=5)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    raise TimeoutError(url)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, help="an older checkout: the first arm")
    p.add_argument("--before-without", default="", help="packages the before arm's server must not import")
    p.add_argument("--after-path", default="", help="a folder of packages on the after arm's path")
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--step-ms", default="10,20", help="the stand-in worker's step time per level")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "http_stream_cpu.json")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from xinserve.server.bench.cli import machine
    from xinserve.server.bench.launch import free_port
    from xinserve.server.embedded_model.factory import ensure_tiny_model

    arms = [("after", ROOT, [], [x for x in args.after_path.split(os.pathsep) if x])]
    if args.before is not None:
        arms.insert(0, ("before", args.before.resolve(), [m for m in args.before_without.split(",") if m], []))
    levels = list(zip(map(int, args.concurrency.split(",")), map(float, args.step_ms.split(","))))
    runs: dict[str, dict[str, list[float]]] = {label: {} for label, *_ in arms}
    with tempfile.TemporaryDirectory(prefix="xinserve-http-cpu-") as tmp:
        scratch = Path(tmp)
        model = ensure_tiny_model(scratch, "llama-h256-l4", hidden_size=256, num_layers=4, num_heads=4,
                                  num_kv_heads=2)
        servers = {}
        try:
            for conc, step_ms in levels:
                for label, root, without, extra in arms:
                    servers[label, conc] = _start(root, without, extra, free_port(), model, step_ms, scratch)
                    asyncio.run(_load(servers[label, conc][1], conc, conc, 8))  # first-call costs out
            for rep in range(args.repeats):
                for conc, _ in levels:
                    for label, *_ in arms if rep % 2 == 0 else reversed(arms):
                        proc, url = servers[label, conc]
                        before = cpu_s(proc.pid)
                        chunks = asyncio.run(_load(url, conc, 2 * conc, args.output_tokens))
                        tokens = 2 * conc * args.output_tokens
                        us = (cpu_s(proc.pid) - before) / tokens * 1e6
                        runs[label].setdefault(f"c={conc}", []).append(us)
                        print(f"rep {rep} c={conc:<3} {label:<7} {us:7.1f} us CPU per token "
                              f"({chunks / tokens:.2f} chunks per token)", flush=True)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    summary = {level: {label: statistics.median(runs[label][level]) for label in runs}
               for level in runs[arms[0][0]]}
    print(f"{'level':<8}" + "".join(f"{label + ' us/token':>20}" for label in runs))
    for level, row in summary.items():
        print(f"{level:<8}" + "".join(f"{row[label]:>20.1f}" for label in runs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine(), "load_average": os.getloadavg(), "output_tokens": args.output_tokens,
        "arms": [{"label": label, "root": str(root), "without": without, "path": extra}
                 for label, root, without, extra in arms],
        "step_ms": dict(zip(args.concurrency.split(","), args.step_ms.split(","))),
        "runs": runs, "summary_median_us_per_token": summary}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
