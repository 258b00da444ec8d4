"""Which CPU workers time their thread count at start (engines/worker/thread_split.py): the server's side."""

from xinserve.server.config import parse_config
from xinserve.server.pool.model_pool import ModelPool


def engine_kwargs(**settings) -> dict:
    config = parse_config({"models": [{"name": "m", "path": "/m", **settings}]})
    pool = ModelPool(config.models[0], cpu_threads=1, log_level=20, max_cpu_threads=2)
    return pool._spec(pool.workers[0], "/m", "/m", "/tmp").engine_kwargs


def test_a_cpu_worker_times_up_to_every_core_unless_its_threads_are_set():
    assert engine_kwargs()["max_cpu_threads"] == 2
    assert engine_kwargs(cpu_threads=1)["max_cpu_threads"] is None  # the user's count stands
    assert engine_kwargs(max_cpu_threads=4)["max_cpu_threads"] == 4
    assert engine_kwargs(workers=["cpu"], tensor_parallel_size=2)["max_cpu_threads"] is None  # ranks split theirs
