"""A process that is done leaves without the exit's walk over its heap (engines/worker/process_exit.py):
the ``xinserve`` command and a server's worker freeze their live objects before they exit."""

import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, check=False)


def test_leave_quickly_leaves_the_collector_no_live_object_to_walk():
    done = python("""
        import gc
        from xinserve.engines.worker.process_exit import leave_quickly
        cycles = [[i] for i in range(10_000)]
        for c in cycles:
            c.append(c)
        before = len(gc.get_objects())
        leave_quickly()
        print(before, len(gc.get_objects()), gc.get_freeze_count())
    """)
    assert done.returncode == 0, done.stderr
    before, after, frozen = map(int, done.stdout.split())
    assert before > 10_000 and after == 0 and frozen >= before


def test_the_xinserve_command_freezes_its_heap_before_it_exits():
    # ``python -m xinserve.server.cli bench`` against a closed port (torch imported, nothing served); an exit
    # hook sees the heap as the interpreter's exit finds it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    done = python("""
        import atexit, gc, runpy, sys
        atexit.register(lambda: print("frozen", gc.get_freeze_count(), "live", len(gc.get_objects())))
        sys.argv = ["xinserve", "bench", "--base-url", sys.argv[1], "--num-prompts", "1"]
        runpy.run_module("xinserve.server.cli", run_name="__main__")
    """, closed)
    assert done.returncode == 1 and "cannot reach" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    _, frozen, _, live = done.stdout.splitlines()[-1].split()
    assert int(frozen) > 100_000 and int(live) < 1000


def test_a_worker_freezes_its_heap_after_shutdown(tiny_model_dir, monkeypatch, tmp_path):
    """``run_worker`` in this process (its exit hook recorded, not run): loaded, told to shut down,
    it closes its engine and sockets, then leaves quickly."""
    import zmq

    from xinserve.server.worker import engine_worker as worker
    from xinserve.server.worker import messages

    left = []
    monkeypatch.setattr(worker, "leave_quickly", lambda: left.append("left"))
    monkeypatch.setattr(worker.signal, "signal", lambda *args: None)  # pytest keeps its own handlers
    ctx = zmq.Context()
    to_worker, from_worker = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_worker.bind(f"ipc://{tmp_path}/in")
    from_worker.bind(f"ipc://{tmp_path}/out")
    spec = worker.WorkerSpec("tiny", "cpu", "cpu", str(tiny_model_dir), {"num_kv_blocks": 16},
                             f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    # sent once the worker connects; it is the first message its loop reads
    sender = threading.Thread(target=to_worker.send, args=(messages.encode(messages.Shutdown()),))
    sender.start()
    try:
        worker.run_worker(spec)
        sender.join(10)
        assert isinstance(messages.decode_from_worker(from_worker.recv()), messages.Ready)
    finally:
        to_worker.close(linger=0)
        from_worker.close(linger=0)
        ctx.term()
    assert left == ["left"]
