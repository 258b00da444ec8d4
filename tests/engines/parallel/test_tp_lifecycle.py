"""The life of an offline tensor-parallel engine: engines built and dropped one after another in one
process each work (``del`` + garbage collection, or ``with``), and leave no process group, rank or
rendezvous port behind; ranks started from a thread that then exits keep serving; ranks leave when
rank 0's process dies. Starting a group of ranks costs seconds, so the engines are few."""

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.engines.test_llm_vs_transformers import GREEDY, MAX_TOKENS, Reference, random_prompts
from xinserve.engines import LLM

REPO_ROOT = Path(__file__).resolve().parents[3]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie nobody reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _expected(reference: Reference, prompts: list[list[int]]) -> list[list[int]]:
    return [reference.generate(p) for p in prompts]


@pytest.mark.slow
def test_three_engines_in_a_loop_each_work_and_leave_nothing_behind(tiny_model_dir):
    """Before: the second engine failed with "trying to initialize the default process group twice"
    after ``del`` of the first, whose group nothing released."""
    reference = Reference(tiny_model_dir)
    prompts = random_prompts(3, reference.vocab_size, seed=5, lengths=(3, 12))
    want = _expected(reference, prompts)
    for release in ("del", "with", "del"):
        llm = LLM(tiny_model_dir, tensor_parallel_size=2, num_kv_blocks=32, block_size=4)
        pids = [proc.pid for proc in llm.engine.runner.followers.values()]
        port = llm.engine.runner.group.store.port
        if release == "with":
            with llm:
                # a second group while this one lives is refused up front, and this one still serves
                with pytest.raises(RuntimeError, match="already holds a tensor-parallel group"):
                    LLM(tiny_model_dir, tensor_parallel_size=2)
                got = [r.token_ids for r in llm.generate(prompts, GREEDY)]
        else:
            got = [r.token_ids for r in llm.generate(prompts, GREEDY)]
        del llm
        gc.collect()
        assert got == want, f"engine released by {release!r}"
        assert not dist.is_initialized()
        assert _wait_gone(pids, 5) == []
        assert _port_free(port)


# Rank 0 is built in a thread that ends before the engine is used, then serves from the main thread;
# then its process dies without any clean-up, as a killed worker would.
_CHILD = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    from xinserve.engines import LLM, SamplingParams

    holder = {}
    thread = threading.Thread(target=lambda: holder.update(
        llm=LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=32, block_size=4)))
    thread.start()
    thread.join()
    time.sleep(1)  # time for a rank killed by its starting thread's exit to be gone
    llm = holder["llm"]
    params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]))
    tokens = [r.token_ids for r in llm.generate(json.loads(sys.argv[2]), params)]
    pids = [proc.pid for proc in llm.engine.runner.followers.values()]
    print(json.dumps({"tokens": tokens, "pids": pids}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.slow
def test_ranks_started_from_an_ended_thread_serve_and_leave_when_rank_0_dies(tiny_model_dir):
    """Before: PR_SET_PDEATHSIG killed the ranks as soon as the thread that started them ended."""
    reference = Reference(tiny_model_dir)
    prompts = random_prompts(2, reference.vocab_size, seed=6, lengths=(3, 12))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-c", _CHILD, str(tiny_model_dir), json.dumps(prompts), str(MAX_TOKENS)]
    child = subprocess.run(command, check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["tokens"] == _expected(reference, prompts)
    assert report["pids"] and _wait_gone(report["pids"], 10) == []
