"""Padded decode buckets compiled with torch.compile on the CPU (engines/worker/decode_buckets.py,
engines/worker/graphs.py): compiled decode equals eager token for token across bucket boundaries with
preemption and prefix caching; padded rows never touch a real sequence's KV or output; a failed
compile falls back to eager with a log line; ``compile: off`` and ``enforce_eager`` never compile.

Inductor compiles take seconds each, so one compiled engine (a one-layer model, three buckets) is
shared by the module. Its buckets compile in a child process (engines/compile/child.py) started by the
background warm-up (engines/worker/warmup.py), which loads each; the tests wait for it (``compiled_engine``)."""

import argparse
import dataclasses
import logging
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import xinserve.engines.compile.child_process
import xinserve.engines.worker.graphs
import xinserve.engines.worker.step_inputs
import xinserve.engines.worker.warmup
from xinserve.engines import LLM, EngineConfig, SamplingParams
from xinserve.engines.core.scheduler import ScheduledSeq
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.worker.decode_buckets import bucket_for, bucket_sizes
from xinserve.server.cli.main import _add_serve_args, build_config
from xinserve.server.config import ConfigError, parse_config

BUCKETS = [1, 4, 9]  # batches 1, 3, 8, 9 land in 1, 4 (one padded row), 9 (one padded row), 9
BS = 4
OPTIONS = {"block_size": BS, "num_kv_blocks": 40, "max_num_seqs": 9, "max_model_len": 64}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
COMPILE_TIMEOUT_S = 900


def compiled_engine(*args, **kwargs) -> LLM:
    """An ``LLM`` once its background warm-up (kernel builds, bucket compiles) is over."""
    llm = LLM(*args, **kwargs)
    assert llm.engine.warmup.done.wait(COMPILE_TIMEOUT_S)
    return llm


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama", num_layers=1, max_position_embeddings=64)


@pytest.fixture(scope="module")
def compiled(model):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(xinserve.engines.worker.graphs, "bucket_sizes", lambda max_num_seqs: BUCKETS)
        llm = compiled_engine(model, compile="on", **OPTIONS)
    assert llm.engine.runner.decode_graphs is not None
    return llm


@pytest.fixture(scope="module")
def eager(model):
    return LLM(model, compile="off", **OPTIONS)


def prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    """Prompts of 10-17 tokens sharing an 8-token prefix (two whole blocks)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(8)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 9))] for _ in range(count)]


def test_bucket_sizes_and_choice():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(9) == [1, 2, 4, 8, 9]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert [bucket_for(n, [1, 4, 9]) for n in (1, 2, 3, 4, 5, 9, 10)] == [1, 4, 4, 4, 9, 9, None]


def test_compiled_decode_equals_eager_across_buckets_with_preemption_and_prefix_caching(compiled, eager):
    graphs = compiled.engine.runner.decode_graphs
    assert graphs.kind == "compiled" and sorted(graphs.steps) == BUCKETS
    # what /health shows of each worker
    done = {str(b): {"state": "compiled", "error": None} for b in BUCKETS}
    assert compiled.engine.warmup.report() == {"mode": "on", "kind": "compiled", "settled": True, "buckets": done,
                                               "progress": {"phase": "settled", "done": 3, "total": 3}}
    assert eager.engine.warmup.report() == {"mode": "off", "kind": "eager", "settled": True, "buckets": {},
                                            "progress": {"phase": "settled", "done": 0, "total": 0}}
    before, runs_before = graphs.steps_run, graphs.bucket_runs.copy()
    vocab = compiled.engine.vocab_size
    for seed, count in enumerate((1, 3, 8, 9)):
        batch = prompts(vocab, count, seed)
        got = [r.token_ids for r in compiled.generate(batch, GREEDY)]
        want = [r.token_ids for r in eager.generate(batch, GREEDY)]
        assert got == want, f"batch of {count}"
    stats = compiled.engine.stats()
    # 9 sequences of up to 27 tokens need 7 blocks each (2 shared) of the 40: the largest batches preempt.
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    assert stats == eager.engine.stats()  # the same schedule on both paths
    assert graphs.steps_run - before >= 4 * 9  # every batch decoded compiled
    assert set(graphs.bucket_runs - runs_before) == set(BUCKETS)  # in each of the three buckets


def test_compiled_buckets_equal_transformers_and_go_eager_once_their_kernels_change(compiled, model):
    """Each bucket's loaded step (called without guards) gives transformers' greedy tokens; once a layer's
    kernel ops are not those it was compiled with (a swap), that bucket runs eagerly, and the tokens stay."""
    graphs = compiled.engine.runner.decode_graphs
    batch = prompts(compiled.engine.vocab_size, 3, seed=13)  # bucket 4
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False, top_p=None,
                            top_k=None, temperature=None)[0, len(p):].tolist() for p in batch]
    runs = graphs.bucket_runs[4]
    assert [r.token_ids for r in compiled.generate(batch, GREEDY)] == want
    assert graphs.bucket_runs[4] - runs >= GREEDY.max_tokens - 1
    steps, states = dict(graphs.steps), dict(graphs.states)
    layer = next(m for m in compiled.engine.runner.model.modules() if getattr(m, "ops", None) is not None)
    old_ops = layer.ops
    try:
        layer.ops = dataclasses.replace(old_ops)  # equal functions, another object: as after a swap
        assert [r.token_ids for r in compiled.generate(batch, GREEDY)] == want
        assert 4 not in graphs.steps and graphs.states[4] == "failed" and "kernels changed" in graphs.errors[4]
    finally:
        layer.ops = old_ops
        graphs.steps.update(steps)
        graphs.states.update(states)
        graphs.errors.pop(4, None)


def test_async_steps_run_compiled_buckets_without_building_a_gather_plan(compiled, eager, monkeypatch):
    """With async scheduling a step is prepared without the decode part's gather plan
    (engines/worker/step_inputs.py): a compiled bucket does not read it, and only a step that runs eagerly builds
    it, on the step thread. Greedy tokens equal the eager engine's, with preemption and prefix hits."""
    engine = compiled.engine
    batch = prompts(engine.vocab_size, 9, seed=21)
    want = [r.token_ids for r in eager.generate(batch, GREEDY)]
    built, forwards = [], []
    build = xinserve.engines.worker.step_inputs.build_decode_gather
    monkeypatch.setattr(xinserve.engines.worker.step_inputs, "build_decode_gather", lambda *a: built.append(a) or build(*a))
    graphs, runner = engine.runner.decode_graphs, engine.runner
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda batch: forwards.append(batch) or forward(batch))
    preemptions, runs = engine.scheduler.num_preemptions, graphs.steps_run
    stepper = engine.async_steps()
    for i, prompt in enumerate(batch):
        engine.add_request(f"async-{i}", prompt, GREEDY)
    got: dict[str, list[int]] = {}
    while stepper.has_unfinished():
        for out in stepper.step().outputs:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    stepper.close()
    assert [got[f"async-{i}"] for i in range(len(batch))] == want
    assert stepper.overlapped > 0 and stepper.synchronous == 0
    assert engine.scheduler.num_preemptions > preemptions
    compiled_steps = graphs.steps_run - runs
    assert compiled_steps >= GREEDY.max_tokens - 1
    assert all(b.metadata.decode_gather is None for b in forwards[-3:])  # the last steps: compiled decodes
    # A gather plan is built only for a step that ran eagerly (one with prefill rows), never for a compiled one.
    assert len(built) <= len(forwards) - compiled_steps < len(forwards)


def decode_step(vocab_size: int) -> list[ScheduledSeq]:
    """Three sequences of 5, 9 and 14 tokens each decoding its last token, in blocks 0-7."""
    rng = random.Random(7)
    scheduled, block = [], 0
    for length in (5, 9, 14):
        seq = Sequence(100 + length, f"r{length}", [rng.randrange(3, vocab_size) for _ in range(length)],
                       SamplingParams(temperature=0, max_tokens=4))
        count = -(-length // BS)
        seq.block_table = list(range(block, block + count))
        block += count
        seq.num_computed_tokens = length - 1
        scheduled.append(ScheduledSeq(seq, 1))
    return scheduled


def test_padded_rows_never_change_real_kv_or_outputs(compiled, eager):
    """A step of 3 in bucket 4: the padded row writes only the scratch block, and every real slot
    and token equals an eager step from the same cache."""
    runner, reference = compiled.engine.runner, eager.engine.runner
    scratch = runner.scratch_block
    assert scratch == runner.kv_cache.shape[2] - 1 == OPTIONS["num_kv_blocks"]
    torch.manual_seed(0)
    runner.kv_cache.copy_(torch.randn_like(runner.kv_cache))
    reference.kv_cache.copy_(runner.kv_cache)
    before = runner.kv_cache.clone()
    steps = runner.decode_graphs.steps_run
    scheduled = decode_step(compiled.engine.vocab_size)
    got = [t.token_ids for t in runner.execute(scheduled)]
    assert runner.decode_graphs.steps_run == steps + 1
    want = [t.token_ids for t in reference.execute(scheduled)]
    assert got == want
    # [2, L, N + 1, BS, KVH, D] -> which (block, offset) slots changed
    changed = (runner.kv_cache != before).flatten(4).any(-1).any(0).any(0).nonzero().tolist()
    real = [[s.seq.block_table[(n - 1) // BS], (n - 1) % BS] for s, n in ((s, s.seq.num_tokens) for s in scheduled)]
    assert [slot for slot in changed if slot[0] != scratch] == real
    assert [scratch, 0] in changed  # the padded row's slot
    torch.testing.assert_close(runner.kv_cache[:, :, :scratch], reference.kv_cache[:, :, :scratch], rtol=1e-5,
                               atol=1e-5)


def test_a_failed_compile_process_leaves_every_bucket_eager_with_its_reason(model, eager, monkeypatch, tmp_path, caplog):
    """The child cannot even start (here: an interpreter that exits 1): every bucket is "failed" with the
    child's last words, and the engine generates eager's tokens."""
    monkeypatch.setenv("XINSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(xinserve.engines.compile.child_process.sys, "executable", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="xinserve.engines.worker.warmup"):
        llm = compiled_engine(model, compile="on", **OPTIONS)
    report = llm.engine.warmup.report()
    assert {b["state"] for b in report["buckets"].values()} == {"failed"} and report["settled"]
    assert {b["error"] for b in report["buckets"].values()} == {"the compile process ended with status 1"}
    assert "the compile process failed" in caplog.text
    batch = prompts(llm.engine.vocab_size, 3, seed=11)
    assert [r.token_ids for r in llm.generate(batch, GREEDY)] == [r.token_ids for r in eager.generate(batch, GREEDY)]


def test_a_restarted_engine_loads_its_buckets_before_ready_without_a_child(compiled, model, monkeypatch):
    """The same model and settings again (a restart, a replica on the shared cache): every bucket is on
    disk, so the engine loads them in its constructor (settled at ready, even warming in the background)
    and starts no compile process."""
    started, loads = [], []
    monkeypatch.setattr(xinserve.engines.worker.warmup, "CompileChild", lambda spec, directory: started.append(spec))
    monkeypatch.setattr(xinserve.engines.worker.graphs, "bucket_sizes", lambda max_num_seqs: BUCKETS)
    load = xinserve.engines.worker.warmup.artifacts.load
    monkeypatch.setattr(xinserve.engines.worker.warmup.artifacts, "load",
                        lambda directory, name: loads.append(name) or load(directory, name))
    llm = LLM(model, compile="on", warm_up_in_background=True, **OPTIONS)
    report = llm.engine.warmup.report()
    assert report["settled"] and llm.engine.warmup.thread is None and started == []
    assert {b["state"] for b in report["buckets"].values()} == {"compiled"}
    assert sorted(loads) == ["bucket-1", "buckets-2-up"]  # buckets 4 and 9 share one compile, loaded once
    batch = prompts(llm.engine.vocab_size, 3, seed=14)
    want = [r.token_ids for r in compiled.generate(batch, GREEDY)]
    runs = llm.engine.runner.decode_graphs.steps_run
    assert [r.token_ids for r in llm.generate(batch, GREEDY)] == want
    assert llm.engine.runner.decode_graphs.steps_run - runs >= GREEDY.max_tokens - 1


def test_a_failing_compiled_step_goes_eager_for_that_bucket(compiled, eager, monkeypatch, caplog):
    graphs = compiled.engine.runner.decode_graphs
    steps = dict(graphs.steps)

    def broken():
        raise RuntimeError("guard failure")

    monkeypatch.setattr(graphs, "steps", {**steps, 1: broken})
    with caplog.at_level(logging.WARNING, logger="xinserve.engines.worker.graphs"):
        got = compiled.generate(prompts(compiled.engine.vocab_size, 1, seed=12), GREEDY)
    want = eager.generate(prompts(eager.engine.vocab_size, 1, seed=12), GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert 1 not in graphs.steps and "compiled decode for bucket 1 failed" in caplog.text


@pytest.mark.parametrize("options", [{"compile": "off"}, {"compile": "on", "enforce_eager": True}])
def test_compile_off_and_enforce_eager_do_not_compile(model, monkeypatch, options):
    calls = []
    monkeypatch.setattr(xinserve.engines.worker.graphs.torch, "compile", lambda *a, **k: calls.append(a))
    llm = LLM(model, block_size=BS, num_kv_blocks=8, **options)
    assert llm.engine.runner.decode_graphs is None and calls == []


def test_compile_config_validation(monkeypatch):
    with pytest.raises(ValueError, match="compile must be one of auto, off, on, got 'fast'"):
        EngineConfig(model="m", compile="fast")
    assert xinserve.engines.worker.graphs.effective_mode(EngineConfig(model="m", compile="on", enforce_eager=True).compile) == "off"
    monkeypatch.setenv("XINSERVE_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="XINSERVE_COMPILE must be one of auto, off, on"):
        xinserve.engines.worker.graphs.effective_mode(None)
    monkeypatch.setenv("XINSERVE_COMPILE", "on")
    assert xinserve.engines.worker.graphs.effective_mode(None) == "on"
    assert xinserve.engines.worker.graphs.effective_mode("off") == "off"
    with pytest.raises(ConfigError, match="models.0.compile"):
        parse_config({"models": [{"name": "m", "path": "p", "compile": "always"}]})
    settings = parse_config({"models": [{"name": "m", "path": "p", "compile": "off"}]}).models[0]
    assert settings.engine_kwargs()["compile"] == "off" and settings.engine_kwargs()["enforce_eager"] is False
    parser = argparse.ArgumentParser()
    _add_serve_args(parser)
    flagged = build_config(parser.parse_args(["--model", "embedded:xinserve-tiny", "--enforce-eager"]), env={})
    assert flagged.models[0].engine_kwargs()["enforce_eager"] is True
    plain = build_config(parser.parse_args(["--model", "embedded:xinserve-tiny"]), env={})
    assert plain.models[0].engine_kwargs()["enforce_eager"] is False
    with pytest.raises(ConfigError, match="XINSERVE_COMPILE must be one of auto, off, on, got 'always'"):
        build_config(parser.parse_args(["--model", "embedded:xinserve-tiny"]), env={"XINSERVE_COMPILE": "always"})


def test_the_inductor_cache_lives_in_the_xinserve_cache_dir(compiled, monkeypatch, tmp_path):
    assert xinserve.engines.worker.graphs.inductor_cache_dir().name == "inductor"
    assert xinserve.engines.worker.graphs.os.environ["TORCHINDUCTOR_CACHE_DIR"]  # set before the first compile
    monkeypatch.setenv("XINSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert xinserve.engines.worker.graphs.use_inductor_cache() == str(tmp_path / "inductor")
    assert xinserve.engines.worker.graphs.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # a user's own choice is kept
    assert xinserve.engines.worker.graphs.use_inductor_cache() == "/elsewhere"


def test_compiled_moe_decode_equals_eager(tiny_models, monkeypatch):
    """A mixture-of-experts model's decode compiles into one graph (fused_moe is an opaque op: the child
    compiles with fullgraph=True, so a graph break would fail the bucket) that serves every step as the
    routing changes, and its greedy tokens equal eager's."""
    path = tiny_models("mixtral", num_layers=1, max_position_embeddings=64)
    options = {**OPTIONS, "max_num_seqs": 2}
    monkeypatch.setattr(xinserve.engines.worker.graphs, "bucket_sizes", lambda max_num_seqs: [2])  # one bucket: compiles cost
    llm = compiled_engine(path, compile="on", **options)
    assert sorted(llm.engine.runner.decode_graphs.steps) == [2], llm.engine.warmup.report()
    eager = LLM(path, compile="off", **options)
    for seed, count in enumerate((1, 2, 2)):
        batch = prompts(llm.engine.vocab_size, count, seed)
        want = [r.token_ids for r in eager.generate(batch, GREEDY)]
        assert [r.token_ids for r in llm.generate(batch, GREEDY)] == want, f"batch of {count}"
    assert llm.engine.runner.decode_graphs.steps_run >= 3 * (GREEDY.max_tokens - 1)
