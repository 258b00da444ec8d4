"""kernels/musa/ops.py through the fakes of torch_musa and MATE (tests/fakes): each op equals the
reference, the fakes refuse what the real calls refuse, the registry picks the MUSA ops where they
apply and says why where they do not, and a whole greedy generation on the musa path equals the
CPU one token for token. Nothing here runs on a Moore Threads GPU."""

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

import xinserve.engines.core.engine
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.platforms import musa as moore_threads
from xinserve.kernels import kv_quant, registry
from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import TOLERANCE, scrambled_block_tables
from xinserve.kernels.references import dense as reference
from xinserve.kernels.registry import KernelSelectionError, select

FAKES = Path(__file__).resolve().parents[2] / "fakes"
CPU = torch.device("cpu")
# The musa platform's candidates limited to ours and the reference: these tests do not depend on the Triton kernels.
MUSA_KERNELS = ("musa", "reference")
# (query heads, kv heads, head dim, block size): MHA, GQA 3:1 on tiny blocks, 8:1 on MATE's 64-token
# pages, a 128-wide head
SHAPES = [(4, 4, 16, 16), (6, 2, 8, 4), (8, 1, 64, 64), (4, 2, 128, 16)]
SHAPE_IDS = ["mha-d16-bs16", "gqa3-d8-bs4", "gqa8-d64-bs64", "gqa2-d128-bs16"]
DTYPES = [torch.bfloat16, torch.float16]
MODEL_SHAPES = ModelShapes(num_heads=6, num_kv_heads=2, head_dim=16, rotary_dim=16, rope_is_neox=True,
                           hidden_size=96, intermediate_size=64, vocab_size=100, block_size=16)


def load_fake(name: str) -> ModuleType:
    """tests/fakes/<name> as the module ``name``, without putting it on sys.path."""
    spec = importlib.util.spec_from_file_location(name, FAKES / name / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fresh_import(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """Import ``name`` anew (it binds its vendor imports at import time) and forget it after the test."""
    parent_name, _, child = name.rpartition(".")
    parent = importlib.import_module(parent_name)  # the vendor's package (kernels/musa/) may not be imported yet
    # Setting then deleting records the original entry and attribute, which teardown puts back.
    monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(parent, child, None, raising=False)
    monkeypatch.delattr(parent, child)
    return importlib.import_module(name)


def install_fakes(monkeypatch: pytest.MonkeyPatch, with_mate: bool) -> ModuleType:
    """The fakes in place of torch_musa (also as ``torch.musa``) and, optionally, mate (else its
    import fails). Returns kernels/musa/ops.py imported against them."""
    torch_musa = load_fake("torch_musa")
    monkeypatch.setitem(sys.modules, "torch_musa", torch_musa)
    monkeypatch.setattr(torch, "musa", torch_musa, raising=False)
    monkeypatch.setitem(sys.modules, "mate", load_fake("mate") if with_mate else None)
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    return fresh_import(monkeypatch, "xinserve.kernels.musa.ops")


@pytest.fixture
def musa(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return install_fakes(monkeypatch, with_mate=True)


@pytest.fixture
def musa_without_mate(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return install_fakes(monkeypatch, with_mate=False)


def paged_cache(seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Random [N, BS, KVH, D] key and value caches and [S, B] int32 tables over a shuffled pool
    (rows zero-padded), so no kernel can rely on contiguous blocks."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    tables = scrambled_block_tables(seq_lens, block_size, num_blocks, seed=0)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), tables


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES, ids=SHAPE_IDS)
def test_prefill_equals_the_reference(musa, dtype, heads, kv_heads, head_dim, block_size):
    torch.manual_seed(0)
    bs = block_size
    # A whole prompt; chunks after cached prefixes that end mid-block and on a block boundary; a
    # two-token chunk right after a one-token prefix.
    q_lens, seq_lens = [7, 5, bs, 2], [7, bs + 8, 2 * bs, 3]
    key_cache, value_cache, tables = paged_cache(seq_lens, bs, kv_heads, head_dim, dtype)
    query = torch.randn(sum(q_lens), heads, head_dim).to(dtype)
    starts = np.concatenate(([0], np.cumsum(q_lens))).tolist()
    scale = head_dim**-0.5
    args = (torch.from_numpy(tables), starts, seq_lens, scale)
    got = musa.paged_prefill_attention(query, key_cache, value_cache, *args)
    want = reference.paged_prefill_attention(query.float(), key_cache.float(), value_cache.float(), *args)
    assert got.dtype == dtype and got.shape == query.shape
    assert error(got, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES, ids=SHAPE_IDS)
def test_decode_equals_the_reference(musa, dtype, heads, kv_heads, head_dim, block_size):
    torch.manual_seed(0)
    bs = block_size
    lens = [1, bs + 1, 2 * bs + 3, 5]  # one token, just past a block, deep into the third, a short one
    key_cache, value_cache, tables = paged_cache(lens, bs, kv_heads, head_dim, dtype)
    query = torch.randn(len(lens), heads, head_dim).to(dtype)
    lens_np = np.array(lens, np.int32)
    gather = build_decode_gather(tables, lens_np, bs, CPU)
    args = (torch.from_numpy(tables), torch.from_numpy(lens_np), head_dim**-0.5, gather)
    got = musa.paged_decode_attention(query, key_cache, value_cache, *args)
    want = reference.paged_decode_attention(query.float(), key_cache.float(), value_cache.float(), *args)
    assert got.dtype == dtype and got.shape == query.shape
    assert error(got, want) <= TOLERANCE[dtype]


def mate_call(**changes) -> dict:
    """A valid MATE decode call (2 sequences, 4 heads over 2 kv heads, head dim 16, pages of 16),
    with ``changes`` applied."""
    key_cache, value_cache, tables = paged_cache([20, 5], 16, 2, 16, torch.bfloat16)
    call = {
        "q": torch.randn(2, 1, 4, 16).to(torch.bfloat16), "k_cache": key_cache, "v_cache": value_cache,
        "cache_seqlens": torch.tensor([20, 5], dtype=torch.int32), "page_table": torch.from_numpy(tables),
        "softmax_scale": 0.25,
    }
    return {**call, **changes}


def head_major(cache: torch.Tensor) -> torch.Tensor:
    return cache.transpose(1, 2).contiguous()  # [N, KVH, BS, D]: the layout of some other engines


BAD_CALLS = {
    "float32": (lambda c: {k: c[k].float() for k in ("q", "k_cache", "v_cache")}, "float16 or bfloat16"),
    "mixed dtypes": (lambda c: {"q": c["q"].half()}, "same dtype"),
    "int64 page table": (lambda c: {"page_table": c["page_table"].long()}, "page_table must be int32"),
    "int64 lengths": (lambda c: {"cache_seqlens": c["cache_seqlens"].long()}, "cache_seqlens must be .* int32"),
    "3-d query": (lambda c: {"q": c["q"][:, 0]}, r"q must be \(batch_size, seqlen"),
    "head-major cache": (lambda c: {k: head_major(c[k]) for k in ("k_cache", "v_cache")}, "divisible"),
    "strided head dim": (lambda c: {k: c[k].transpose(2, 3).contiguous().transpose(2, 3)
                                    for k in ("k_cache", "v_cache")}, "contiguous last dimension"),
    "table rows != batch": (lambda c: {"page_table": c["page_table"][:1]}, r"page_table must be \(batch_size=2"),
    "length past the table": (lambda c: {"cache_seqlens": torch.tensor([40, 5], dtype=torch.int32)},
                              "outside the page table"),
    "appending k/v": (lambda c: {"k": c["q"], "v": c["q"]}, "does not model k, v"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_the_fake_mate_refuses_what_mate_refuses(musa, case):
    change, says = BAD_CALLS[case]
    call = mate_call()
    with pytest.raises((AssertionError, IndexError, NotImplementedError), match=says):
        sys.modules["mate"].flash_attn_with_kvcache(**{**call, **change(call)})


def test_the_fake_mate_has_no_flash_attention_2_arguments_and_no_192_wide_kernel(musa):
    mate = sys.modules["mate"]
    call = mate_call()
    with pytest.raises(TypeError, match="block_table"):  # FlashAttention-2's name; MATE's is page_table
        mate.flash_attn_with_kvcache(**call, block_table=call["page_table"])
    key_cache, value_cache, tables = paged_cache([20, 5], 16, 2, 160, torch.bfloat16)
    wide = {"q": torch.randn(2, 1, 4, 160).to(torch.bfloat16), "k_cache": key_cache, "v_cache": value_cache,
            "page_table": torch.from_numpy(tables)}
    with pytest.raises(AssertionError, match="headdim 192-192"):
        mate.flash_attn_with_kvcache(**mate_call(**wide))


def test_the_fake_mate_takes_any_page_size_and_aligns_causal_to_the_bottom_right(musa):
    mate = sys.modules["mate"]
    lens = [7, 3]
    key_cache, value_cache, tables = paged_cache(lens, 3, 1, 8, torch.float16)  # pages of 3 tokens
    query = torch.randn(2, 2, 2, 8).to(torch.float16)  # two queries per sequence: the last two positions
    lens_t, tables_t = torch.tensor(lens, dtype=torch.int32), torch.from_numpy(tables)
    got = mate.flash_attn_with_kvcache(query, key_cache, value_cache, cache_seqlens=lens_t, page_table=tables_t,
                                       causal=True)
    want = reference.paged_prefill_attention(
        query.flatten(0, 1).float(), key_cache.float(), value_cache.float(), tables_t, [0, 2, 4], lens, 8**-0.5
    )
    assert error(got.flatten(0, 1), want) <= TOLERANCE[torch.float16]


def test_the_fake_torch_musa_knows_one_card(musa):
    torch.musa.set_device("musa:0")
    assert torch.musa.current_device() == 0 and torch.musa.device_count() == 1
    free, total = torch.musa.mem_get_info(0)
    assert 0 < free <= total
    torch.musa.synchronize()
    with pytest.raises(RuntimeError, match="invalid device ordinal 1"):
        torch.musa.set_device(1)
    with pytest.raises(ValueError, match="Expected a musa device"):
        torch.musa.mem_get_info(CPU)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_registry_chooses_the_musa_attention(musa, dtype):
    selection = select(MUSA_KERNELS, CPU, dtype, MODEL_SHAPES)
    assert selection.chosen["prefill_attention"] == "musa" and selection.chosen["decode_attention"] == "musa"
    assert selection.ops.paged_decode_attention is musa.paged_decode_attention
    # The ops MUSA has nothing of its own for go to the reference without a complaint.
    assert selection.chosen["rms_norm"] == "reference" and not selection.rejected


def test_without_mate_decode_falls_back_and_says_why(musa_without_mate):
    selection = select(MUSA_KERNELS, CPU, torch.bfloat16, MODEL_SHAPES)
    assert selection.chosen["prefill_attention"] == "musa"
    assert selection.chosen["decode_attention"] == "reference"
    [(impl, reason)] = selection.rejected["decode_attention"]
    assert impl == "musa" and reason.startswith("not installed (mate")
    with pytest.raises(KernelSelectionError, match=r"decode_attention=musa was forced .* not installed \(mate"):
        select(MUSA_KERNELS, CPU, torch.bfloat16, MODEL_SHAPES, {"decode_attention": "musa"})


@pytest.mark.parametrize(
    ("dtype", "head_dim", "prefill_says", "decode_says"),
    [
        (torch.float32, 16, "no flash path", "float32 unsupported"),
        (torch.bfloat16, 160, None, "head_dim 160 unsupported"),  # torch_musa has a 160 kernel, MATE not
        (torch.bfloat16, 256, "head_dim 256 unsupported", None),  # MATE has a 256 kernel, torch_musa not
        (torch.float16, 100, None, "head_dim 100 unsupported"),  # not a multiple of 8
    ],
)
def test_declared_limits_send_the_op_to_the_next_candidate(musa, dtype, head_dim, prefill_says, decode_says):
    shapes = replace(MODEL_SHAPES, head_dim=head_dim, rotary_dim=head_dim)
    selection = select(MUSA_KERNELS, CPU, dtype, shapes)
    for op, says in (("prefill_attention", prefill_says), ("decode_attention", decode_says)):
        if says is None:
            assert selection.chosen[op] == "musa" and op not in selection.rejected
        else:
            assert selection.chosen[op] == "reference"
            assert [impl for impl, _ in selection.rejected[op]] == ["musa"]
            assert says in selection.rejected[op][0][1]


def test_a_windowed_model_keeps_the_reference_attention(musa):
    selection = select(MUSA_KERNELS, CPU, torch.bfloat16, replace(MODEL_SHAPES, sliding_window=64))
    for op in ("prefill_attention", "decode_attention"):
        assert selection.chosen[op] == "reference"
        assert selection.rejected[op] == [("musa", "sliding window unsupported (not implemented for MUSA attention here)")]


@pytest.fixture
def on_musa(musa, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``device="musa:0"`` reaches the engine as a musa platform whose tensors live on the CPU (a
    fake cannot make MUSA tensors), so the runner selects kernels for platform "musa"."""
    platform = replace(moore_threads.record(CPU), default_block_size=16, default_kv_cache_memory_fraction=0.1,
                       free_memory=lambda: torch.musa.mem_get_info()[0], synchronize=torch.musa.synchronize,
                       kernel_preference=MUSA_KERNELS, dist_backend="gloo")
    real = xinserve.engines.core.engine.get_platform
    monkeypatch.setattr(xinserve.engines.core.engine, "get_platform", lambda device: platform if device == "musa:0" else real(device))
    return musa


def test_greedy_generation_on_musa_equals_cpu(on_musa, tiny_models):
    """Chunked prefill (a 16-token budget), prefix-cache hits (the second batch shares the first
    prompt's opening blocks) and preemption (6 blocks of 16 for three growing sequences).

    In float16, a MUSA flash dtype: bfloat16 rounds this random model's logits to steps of 1/16,
    where a last-bit difference between two correct attention kernels already flips tokens. The
    CPU run's top-2 log-probs show that no token here is that close to a tie."""
    options = {"dtype": "float16", "block_size": 16, "num_kv_blocks": 6, "max_num_batched_tokens": 16}
    opening = "The librarian, a tall woman with silver glasses, believed that every book waited for its reader"
    batches = [[opening + " until the light grew strong."],
               [opening + ending for ending in (" while", " and an old sailor sat", ". A small library")]]
    runs = {}
    for device in ("cpu", "musa:0"):
        llm = LLM(tiny_models("llama"), device=device, **options)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2 if device == "cpu" else None)
        runs[device] = [out.outputs[0] for batch in batches for out in llm.generate(batch, params)]
        stats = llm.engine.stats()
        assert stats.prefix_cache_hits_total > 0 and stats.num_preemptions_total > 0, device
    margins = [t.top_logprobs[0] - t.top_logprobs[1] for out in runs["cpu"] for t in out.logprobs]
    assert min(margins) >= 0.04, "a greedy choice is near a tie on CPU: these prompts no longer test anything"
    assert llm.engine.runner.kernels.chosen["prefill_attention"] == "musa"
    assert llm.engine.runner.kernels.ops.paged_decode_attention is on_musa.paged_decode_attention
    assert len(llm.tokenizer.encode(batches[0][0])) > options["max_num_batched_tokens"]  # so prefill was chunked
    assert [out.token_ids for out in runs["musa:0"]] == [out.token_ids for out in runs["cpu"]]


# ---- an 8-bit KV cache (--kv-cache-dtype fp8 / int8), read back in the model's dtype ----

EIGHT_BIT = [torch.float8_e4m3fn, torch.int8]


def stored_cache(seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, kv_dtype: torch.dtype):
    """As ``paged_cache``, with the values stored as the pool stores them (kernels/kv_quant.py)."""
    key_cache, value_cache, tables = paged_cache(seq_lens, block_size, kv_heads, head_dim, torch.float32)
    return kv_quant.quantize(key_cache, kv_dtype), kv_quant.quantize(value_cache, kv_dtype), tables


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES[2:], ids=SHAPE_IDS[2:])
def test_8bit_cache_attention_equals_the_reference_over_the_same_stored_cache(musa, kv_dtype, heads, kv_heads,
                                                                                head_dim, block_size):
    torch.manual_seed(0)
    bs, dtype = block_size, torch.bfloat16
    lens = [1, bs + 1, 2 * bs + 3, 5]
    key_cache, value_cache, tables = stored_cache(lens, bs, kv_heads, head_dim, kv_dtype)
    assert key_cache.shape[-1] == head_dim + 4  # codes, then the scale's 4 bytes
    query = torch.randn(len(lens), heads, head_dim).to(dtype)
    lens_np = np.array(lens, np.int32)
    args = (torch.from_numpy(tables), torch.from_numpy(lens_np), head_dim**-0.5,
            build_decode_gather(tables, lens_np, bs, CPU))
    got = musa.paged_decode_attention(query, key_cache, value_cache, *args)
    assert got.dtype == dtype and error(got, reference.paged_decode_attention(query.float(), key_cache, value_cache,
                                                                              *args)) <= TOLERANCE[dtype]
    q_lens, seq_lens = [7, 5, 2], [7, bs + 8, 3]  # a whole prompt, chunks after cached prefixes
    key_cache, value_cache, tables = stored_cache(seq_lens, bs, kv_heads, head_dim, kv_dtype)
    query = torch.randn(sum(q_lens), heads, head_dim).to(dtype)
    args = (torch.from_numpy(tables), [0, 7, 12, 14], seq_lens, head_dim**-0.5)
    got = musa.paged_prefill_attention(query, key_cache, value_cache, *args)
    want = reference.paged_prefill_attention(query.float(), key_cache, value_cache, *args)
    assert got.dtype == dtype and error(got, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT, ids=str)
def test_the_registry_chooses_the_musa_attention_for_an_8bit_cache(musa, kv_dtype):
    selection = select(MUSA_KERNELS, CPU, torch.bfloat16, replace(MODEL_SHAPES, kv_cache_dtype=kv_dtype))
    assert selection.chosen["prefill_attention"] == "musa" and selection.chosen["decode_attention"] == "musa"
    assert selection.chosen["write_kv"] == "reference" and not selection.rejected  # torch ops quantize on the card
    # a half-precision cache in the other half dtype has no reader here: the reference serves, and says why
    selection = select(MUSA_KERNELS, CPU, torch.bfloat16, replace(MODEL_SHAPES, kv_cache_dtype=torch.float16))
    assert selection.chosen["decode_attention"] == "reference"
    assert selection.rejected["decode_attention"] == [
        ("musa", "KV cache dtype torch.float16 unsupported (its kernels read an 8-bit cache or one in the model's dtype)")]


def test_without_mate_an_8bit_cache_decodes_on_the_reference_and_says_why(musa_without_mate):
    selection = select(MUSA_KERNELS, CPU, torch.bfloat16, replace(MODEL_SHAPES, kv_cache_dtype=torch.float8_e4m3fn))
    assert selection.chosen["prefill_attention"] == "musa" and selection.chosen["decode_attention"] == "reference"
    assert selection.rejected["decode_attention"][0][1].startswith("not installed (mate")
