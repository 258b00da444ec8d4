"""A CPU engine's torch thread count, chosen at start by timing its decode step (engines/worker/thread_split.py)."""

from types import SimpleNamespace

import pytest
import torch

from xinserve.engines import LLM
from xinserve.engines.platforms import get_platform
from xinserve.engines.worker import thread_split
from xinserve.engines.worker.thread_split import (
    ROUNDS,
    ThreadChoice,
    candidates,
    choose,
    choose_cpu_threads,
    decode_step_timer,
    for_engine,
)
from xinserve.kernels.probes.timing import TimingCache
from xinserve.server.worker.engine_worker import _engine_info


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class StepDouble:
    """Stands in for timing a decode step: its seconds depend on the thread count set when it runs."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.seconds, self.calls = seconds, []

    def __call__(self) -> float:
        self.calls.append(torch.get_num_threads())
        return self.seconds[torch.get_num_threads()]


@pytest.mark.parametrize(("seconds", "best"), [({1: 0.010, 2: 0.006}, 2), ({1: 0.006, 2: 0.010}, 1),
                                               ({1: 0.008, 2: 0.008}, 1)])
def test_the_fastest_thread_count_is_kept_and_set(tmp_path, restore_threads, seconds, best):
    step = StepDouble(seconds)
    choice = choose([1, 2], step, "k", TimingCache(tmp_path / "t.json"))
    assert step.calls == [1, 2] * (1 + ROUNDS)  # in turns, each under its own thread count
    assert choice == ThreadChoice(best, "measured", seconds)  # a tie goes to fewer threads
    assert torch.get_num_threads() == best


def test_the_choice_is_cached_per_machine_and_shape(tmp_path, restore_threads):
    path = tmp_path / "t.json"
    choose([1, 2], StepDouble({1: 0.010, 2: 0.004}), "shape-a", TimingCache(path))
    torch.set_num_threads(1)
    again = StepDouble({1: 0.001, 2: 0.009})
    choice = choose([1, 2], again, "shape-a", TimingCache(path))  # a restart: read back, nothing timed
    assert again.calls == [] and choice.threads == 2 and choice.source == "cached"
    other = choose([1, 2], again, "shape-b", TimingCache(path))  # another shape is timed
    assert again.calls == [1, 2] * (1 + ROUNDS) and other.threads == 1 and other.source == "measured"


class BusyMachineModel:
    """A decode forward on a simulated clock: ``base`` seconds per thread count, plus ``burst`` while the
    clock is below ``busy_until`` (another process starting beside the engine)."""

    def __init__(self, base: dict[int, float], burst: float, busy_until: float) -> None:
        self.now, self.base, self.burst, self.busy_until = 0.0, base, burst, busy_until

    def __call__(self, *args) -> torch.Tensor:
        self.now += self.base[torch.get_num_threads()] + (self.burst if self.now < self.busy_until else 0.0)
        return torch.zeros(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def test_a_burst_of_other_work_at_start_does_not_decide_the_thread_count(tmp_path, restore_threads, monkeypatch):
    # 1 thread is faster; the machine is busy for the first 0.3 s (under half of the timing), which the
    # first count's forwards alone would fall into if each count were timed in one go.
    model = BusyMachineModel({1: 0.006, 2: 0.008}, burst=0.050, busy_until=0.3)
    monkeypatch.setattr(thread_split, "time", SimpleNamespace(perf_counter=lambda: model.now))
    runner = SimpleNamespace(block_size=16, scratch_block=64, device=torch.device("cpu"), model=model, kv_cache=None)
    choice = choose([1, 2], decode_step_timer(runner, 4, 32), "k", TimingCache(tmp_path / "t.json"))
    assert choice.threads == 1 and torch.get_num_threads() == 1


def test_candidates_are_the_current_count_and_the_most():
    assert candidates(1, 2) == [1, 2]
    assert candidates(2, 2) == [2]
    assert candidates(3, None) == [3]


def test_an_engine_times_its_decode_step_at_start_and_reports_it(tiny_models, tmp_path, monkeypatch,
                                                                 restore_threads):
    monkeypatch.setenv("XINSERVE_CACHE_DIR", str(tmp_path))
    torch.set_num_threads(1)
    llm = LLM(tiny_models("llama"), num_kv_blocks=64, max_num_seqs=8, max_model_len=128, max_cpu_threads=2)
    choice = llm.engine.thread_choice
    assert choice.source == "measured" and set(choice.seconds) == {1, 2}
    assert torch.get_num_threads() == choice.threads == min(choice.seconds, key=choice.seconds.get)
    info = _engine_info(llm.engine, SimpleNamespace(device="cpu"), 0.0)["cpu_threads"]
    assert info["threads"] == choice.threads and set(info["step_ms"]) == {"1", "2"}
    # A second start on this machine reads the timings back (the engine's runner, timed again).
    torch.set_num_threads(1)
    again = choose_cpu_threads(llm.engine.runner, 2, 8, llm.engine.max_model_len)
    assert again.source == "cached" and again.seconds == choice.seconds
    # No choice to make: nothing is timed.
    assert for_engine(SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1, max_cpu_threads=2, max_num_seqs=8),
                      get_platform("cpu"), llm.engine.runner, 128).source == "fixed"


def test_an_mla_engine_times_its_latent_cache_too(tiny_models, tmp_path, monkeypatch, restore_threads):
    monkeypatch.setenv("XINSERVE_CACHE_DIR", str(tmp_path))
    torch.set_num_threads(1)
    llm = LLM(tiny_models("deepseek_v3"), num_kv_blocks=32, max_num_seqs=4, max_model_len=64, max_cpu_threads=2)
    assert llm.engine.thread_choice.source == "measured"  # not the fallback of a failed timing
