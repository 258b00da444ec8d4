"""The CPU workers' OpenMP threads sleep at barriers: the server sets the wait policy before it spawns them."""

import os

import pytest

from server.pool import WORKER_OPENMP_ENV, set_worker_openmp_env


def test_workers_spawned_after_start_get_a_passive_openmp_wait_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    set_worker_openmp_env()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE" == WORKER_OPENMP_ENV["OMP_WAIT_POLICY"]


def test_a_wait_policy_the_user_set_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    set_worker_openmp_env()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
