"""The C++ CPU decode kernel (reads the paged cache in place) against the reference, and end to end."""

import multiprocessing
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from xinserve.engines import LLM, SamplingParams
from xinserve.kernels import kv_quant
from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.cpu import cpp, cpp_build
from xinserve.kernels.references import dense as reference

# (head dim, KV heads, query heads, block size)
SHAPES = [(8, 2, 6, 16), (96, 1, 3, 16), (64, 2, 2, 128), (96, 2, 6, 128), (64, 2, 4, 16)]


def decode_case(shape, lens, dtype, seed=0):
    head_dim, kv_heads, heads, block_size = shape
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 3
    order = np.random.default_rng(seed).permutation(num_blocks)
    tables = np.zeros((len(lens), max(per_seq, default=1)), np.int32)
    start = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[start : start + n]
        start += n
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=g).to(dtype)
    value_cache = torch.randn(cache_shape, generator=g).to(dtype)
    query = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return query, key_cache, value_cache, tables, np.array(lens, np.int32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("lens", [[1], [17, 130, 1, 300], [16, 128, 129]])
def test_decode_equals_the_reference(shape, lens):
    query, key_cache, value_cache, tables_np, lens_np = decode_case(shape, lens, torch.float32)
    tables, seq_lens = torch.from_numpy(tables_np), torch.from_numpy(lens_np)
    gather = build_decode_gather(tables_np, lens_np, shape[3], torch.device("cpu"))
    want = reference.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.3, gather)
    got = cpp.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("growth", [4.0, -0.9])
def test_a_running_max_that_grows_or_stays_over_the_blocks_equals_the_reference(growth):
    """Keys scaled by position: with growth > 0 each block's logits outgrow the last (the kernel rescales
    what came before at every block); with growth < 0 the first block holds the max (no rescale after it)."""
    shape, lens = (64, 2, 4, 16), [300, 45, 8]
    query, key_cache, value_cache, tables_np, lens_np = decode_case(shape, lens, torch.float32, seed=3)
    for s, n in enumerate(lens):
        for position in range(n):
            block, row = tables_np[s, position // 16], position % 16
            key_cache[block, row] = query[s].view(2, 2, 64)[:, 0] * (1 + growth * position / n)
    tables, seq_lens = torch.from_numpy(tables_np), torch.from_numpy(lens_np)
    gather = build_decode_gather(tables_np, lens_np, 16, torch.device("cpu"))
    want = reference.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.125, gather)
    got = cpp.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision_accumulates_in_float32(dtype, tol):
    query, key_cache, value_cache, tables_np, lens_np = decode_case(SHAPES[0], [5, 77, 200], dtype)
    tables, seq_lens = torch.from_numpy(tables_np), torch.from_numpy(lens_np)
    gather = build_decode_gather(tables_np, lens_np, 16, torch.device("cpu"))
    want = reference.paged_decode_attention(query.float(), key_cache.float(), value_cache.float(), tables,
                                            seq_lens, 0.3, gather)
    got = cpp.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.3)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_no_sequences_and_bad_inputs():
    query, key_cache, value_cache, tables_np, lens_np = decode_case(SHAPES[0], [3], torch.float32)
    empty = cpp.paged_decode_attention(query[:0], key_cache, value_cache, torch.from_numpy(tables_np)[:0],
                                       torch.from_numpy(lens_np)[:0], 0.3)
    assert empty.shape == (0, 6, 8)
    with pytest.raises(RuntimeError, match="int32"):
        cpp.paged_decode_attention(query, key_cache, value_cache, torch.from_numpy(tables_np).long(),
                                   torch.from_numpy(lens_np), 0.3)


def test_greedy_generation_with_the_cpp_kernel_equals_the_reference(tiny_models):
    path = tiny_models("llama")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Once upon a time " * k for k in (1, 5, 12)]
    runs = {}
    for impl in ("cpp", "reference"):
        llm = LLM(path, num_kv_blocks=40, block_size=4, max_num_batched_tokens=16,
                  kernels={"decode_attention": impl, "write_kv": impl})
        assert llm.engine.runner.kernels.chosen["decode_attention"] == impl
        assert llm.engine.runner.kernels.chosen["write_kv"] == impl
        runs[impl] = [o.token_ids for o in llm.generate(prompts, params)]
        if impl == "cpp":
            assert llm.engine.stats().num_preemptions_total > 0  # a pool small enough to preempt
    assert runs["cpp"] == runs["reference"]


def _hold_build_lock(build_dir: str, held) -> None:
    with cpp_build._build_lock(Path(build_dir)):
        held.set()
        time.sleep(600)


def test_a_builder_killed_mid_build_does_not_block_the_next_load(tmp_path):
    # torch's lock file, as a builder SIGKILLed mid-build leaves it: a later load must not wait on it.
    (tmp_path / "lock").write_text("")
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Event()
    builder = ctx.Process(target=_hold_build_lock, args=(str(tmp_path), held))
    builder.start()
    try:
        assert held.wait(60)
        assert not (tmp_path / "lock").exists()  # the live builder cleared the stale file
        (tmp_path / "lock").write_text("")  # ... and is now mid-build, with torch's lock taken again
        entered = threading.Event()

        def load() -> None:
            with cpp_build._build_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=load, daemon=True)
        waiter.start()
        assert not entered.wait(1)  # a live builder is waited for
        builder.kill()
        assert entered.wait(30)  # its death releases the flock; its torch lock file is stale
        assert not (tmp_path / "lock").exists()
    finally:
        builder.kill()
        builder.join()


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def holey_case(kind: str | None, head_dim: int, lens: list[int], block_size: int = 16, kv_heads: int = 2):
    """A pool whose blocks not in any live context (holes between them, and the tables' padding) hold
    NaN: a kernel that reads past a context or off its table returns NaN. Returns (query, the clean
    caches, the holed caches, tables, lens), the caches stored in ``kind`` (kernels/kv_quant.py)."""
    g = torch.Generator().manual_seed(head_dim)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = 2 * sum(per_seq) + 1
    order = np.random.default_rng(1).permutation(num_blocks)
    live, holes = order[: sum(per_seq)], order[sum(per_seq) :]
    tables = np.full((len(lens), max(per_seq)), holes[0], np.int32)
    for i, start in enumerate(np.cumsum([0, *per_seq[:-1]])):
        tables[i, : per_seq[i]] = live[start : start + per_seq[i]]
    dtype = kv_quant.storage_dtype(kind, torch.float32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    clean = [kv_quant.quantize(torch.randn(shape, generator=g), dtype) for _ in range(2)]
    poison = kv_quant.quantize(torch.full((len(holes), *shape[1:]), float("nan")), dtype)
    if kv_quant.is_quantized(dtype):  # an 8-bit code has no NaN: the rows' scales are NaN
        poison[..., head_dim:] = torch.full((*poison.shape[:-1], 1), float("nan")).view(torch.int8).view(dtype)
    holed = [c.clone() for c in clean]
    for c in holed:
        c[torch.from_numpy(holes)] = poison
    query = torch.randn(len(lens), 2 * kv_heads, head_dim, generator=g)
    return query, clean, holed, tables, np.array(lens, np.int32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", [None, "bfloat16", "float16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("head_dim", [64, 40])  # 64: the unrolled path; 40: a 32-float chunk and a tail
def test_every_kv_dtype_and_thread_count_equals_the_reference_over_tables_with_holes(kind, head_dim, threads,
                                                                                     restore_threads):
    lens = [1, 15, 16, 17, 200, 513, 3]
    query, clean, holed, tables_np, lens_np = holey_case(kind, head_dim, lens)
    tables, seq_lens = torch.from_numpy(tables_np), torch.from_numpy(lens_np)
    gather = build_decode_gather(tables_np, lens_np, 16, torch.device("cpu"))
    want = reference.paged_decode_attention(query, *clean, tables, seq_lens, 0.2, gather)
    torch.set_num_threads(threads)
    got = cpp.paged_decode_attention(query, *holed, tables, seq_lens, 0.2)
    assert (got - want).abs().max() < 1e-5  # float32 accumulation of the same stored values, no NaN read
    # One sequence alone: its KV heads are split over the threads.
    one = cpp.paged_decode_attention(query[4:5], *holed, tables[4:5], seq_lens[4:5], 0.2)
    assert (one - want[4:5]).abs().max() < 1e-5
    torch.set_num_threads(1)
    # Each (sequence, KV head) is computed alone, whichever thread takes it: the same bits.
    assert torch.equal(cpp.paged_decode_attention(query, *holed, tables, seq_lens, 0.2), got)


@pytest.mark.parametrize("kind", [None, "bfloat16", "float16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_kv_write_stores_the_reference_bytes(kind, dtype):
    g = torch.Generator().manual_seed(3)
    tokens, kv_heads, head_dim, block_size, num_blocks = 7, 2, 40, 16, 5
    kv_dtype = kv_quant.storage_dtype(kind, dtype)
    width = kv_quant.head_width(head_dim, kv_dtype)
    # key and value as the model passes them: views of one fused projection, rows a token apart
    qkv = (3 * torch.randn(tokens, 3 * kv_heads * head_dim, generator=g)).to(dtype)
    qkv[2, :head_dim] = 0  # an all-zero head (8-bit scale 1)
    _, key, value = (x.view(tokens, kv_heads, head_dim) for x in qkv.split(kv_heads * head_dim, dim=-1))
    slots = torch.tensor([0, 15, 16, 40, 79, 33, 1])
    start = kv_quant.quantize(torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g), kv_dtype)
    got, want = [start.clone(), start.clone()], [start.clone(), start.clone()]
    cpp.write_kv(key, value, *got, slots)
    reference.write_kv(key, value, *want, slots)
    for mine, theirs in zip(got, want, strict=True):
        assert mine.shape[-1] == width and torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))


def test_a_kv_write_out_of_the_pool_raises_instead_of_writing():
    cache = [torch.zeros(2, 4, 1, 8) for _ in range(2)]
    new = torch.ones(1, 1, 8)
    for slot in (8, -1):
        with pytest.raises(RuntimeError, match="out of range"):
            cpp.write_kv(new, new, *cache, torch.tensor([slot]))
    assert not any(c.any() for c in cache)


def test_compiled_calls_go_through_the_registered_operators():
    # aot_eager traces with the fake implementations and functionalises the in-place write, as inductor does.
    query, key_cache, value_cache, tables_np, lens_np = decode_case(SHAPES[0], [5, 40], torch.float32)
    tables, seq_lens = torch.from_numpy(tables_np), torch.from_numpy(lens_np)
    new_k, new_v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    slots = (tables[:, 0].long() * 16 + 3).contiguous()

    def step(q, k_cache, v_cache):
        cpp.write_kv(new_k, new_v, k_cache, v_cache, slots)
        return cpp.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3)

    eager_caches = (key_cache.clone(), value_cache.clone())
    want = step(query, *eager_caches)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(query, key_cache, value_cache)
    assert torch.equal(got, want)
    assert torch.equal(key_cache, eager_caches[0]) and torch.equal(value_cache, eager_caches[1])  # written in place


@pytest.fixture
def slow_gil_switches():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1000)  # a thread holding the GIL keeps it until it blocks or releases it itself
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("call", ["module", "operator"])
def test_the_kernels_release_the_gil_while_they_run(call, slow_gil_switches, restore_threads):
    # A long attention call (a hot pool: 256 sequences x 4096 tokens over the same 256 blocks) in a second
    # thread. With the GIL released the main thread runs as soon as the call starts and finds it unfinished;
    # a kernel holding the GIL lets it run only once the call has returned (switch interval 1000 s).
    torch.set_num_threads(1)
    cache = [torch.randn(256, 128, 2, 64) for _ in range(2)]
    tables = torch.arange(256, dtype=torch.int32).repeat(256, 1)[:, :32]
    lens = torch.full((256,), 4096, dtype=torch.int32)
    query = torch.randn(256, 2, 64)
    attend = cpp._extension.paged_decode_attention if call == "module" else cpp._ops.paged_decode_attention
    started, finished = threading.Event(), threading.Event()

    def run() -> None:
        started.set()
        attend(query, *cache, tables, lens, 0.1)
        finished.set()

    worker = threading.Thread(target=run)
    worker.start()
    started.wait()
    during = not finished.is_set()
    worker.join()
    assert during


def test_two_threads_split_the_decode_attention_between_them(restore_threads):
    # at::parallel_for's OpenMP pragma is compiled into the extension (kernels/cpu/cpp_build.py, -fopenmp):
    # without the flag every range runs on the calling thread whatever torch's thread count says. With
    # 2 threads the other thread does part of the work, so the calling thread's CPU time is well under the
    # process's (both counted over the same calls; a loaded machine inflates both alike).
    torch.set_num_threads(2)
    cache = [torch.randn(256, 16, 2, 64) for _ in range(2)]
    tables = torch.arange(256, dtype=torch.int32).repeat(64, 1)
    lens = torch.full((64,), 4096, dtype=torch.int32)
    query = torch.randn(64, 4, 64)
    cpp._extension.paged_decode_attention(query, *cache, tables, lens, 0.1)  # OpenMP's threads started
    thread_start, process_start = time.thread_time(), time.process_time()
    for _ in range(5):
        cpp._extension.paged_decode_attention(query, *cache, tables, lens, 0.1)
    calling_thread, process = time.thread_time() - thread_start, time.process_time() - process_start
    assert calling_thread < 0.8 * process, (calling_thread, process)
