"""The CPU workers' OpenMP threads sleep at barriers: the server sets the wait policy before it spawns them."""

import asyncio
import os

import pytest

from xinserve.server.config import parse_config
from xinserve.server.pool.model_pool import WORKER_OPENMP_ENV, ModelPool, set_worker_openmp_env
from xinserve.server.pool.worker_client import WorkerClient


def test_workers_spawned_after_start_get_a_passive_openmp_wait_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    set_worker_openmp_env()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" == WORKER_OPENMP_ENV["OMP_WAIT_POLICY"]


def test_a_wait_policy_the_user_set_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    set_worker_openmp_env()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_pool_sets_it_before_it_spawns_its_workers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    config = parse_config({"models": [{"name": "m", "path": str(tmp_path)}]})
    pool = ModelPool(config.models[0], cpu_threads=1, log_level=20)
    seen = []
    # Stands in for the spawn: what the child's environment would be (libgomp reads it as torch loads).
    monkeypatch.setattr(WorkerClient, "start", lambda self, spec: seen.append(os.environ.get("OMP_WAIT_POLICY")))
    asyncio.run(pool.start(str(tmp_path)))  # the empty directory has no tokenizer: the pool fails after spawning
    assert seen == ["PASSIVE"]
