"""Speculative verification through the padded decode buckets (engines/worker/decode_rows.py,
engines/worker/decode_buckets.py, engines/worker/graphs.py): a drafted sequence's 1 + k rows are decode rows, each
with its own causal context, so a verification step runs in the bucket of its total rows, mixed with
sequences that do not draft; greedy output still equals transformers; the MTP drafter reads the
target's hidden states from the bucket.

Most tests run each bucket's step eagerly on the bucket's own static buffers (``eager_buckets``:
the padding, the max_model_len-wide plans and the row layout of a compiled step, without inductor's
seconds per compile: tests/engines/worker/compile_doubles.py). One test compiles a bucket for real (in
the compile child), over the reference decode attention."""

import types

import numpy as np
import pytest

import xinserve.engines.worker.graphs
from tests.engines.speculative.doubles import OracleProposer
from tests.engines.test_llm_vs_transformers import GREEDY, Reference, check_against_reference
from tests.engines.worker.compile_doubles import use_doubles
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.core.scheduler import ScheduledSeq
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.worker.decode_buckets import max_decode_rows
from xinserve.engines.worker.decode_rows import decode_rows

BS = 4
PROMPTS = [list(range(10, 18)) * 2, [5, 9, 14, 200, 31, 7], list(range(40, 61)), [3, 99, 3, 99, 3, 99, 7]]


class PartialOracle(OracleProposer):
    """Drafts the expected continuation (some drafts wrong) of the prompts it knows; the others never
    draft, so steps mix drafting and non-drafting sequences."""

    def propose(self, running: list[Sequence]) -> None:
        super().propose([seq for seq in running if tuple(seq.prompt_token_ids) in self.expected])


@pytest.fixture
def eager_buckets(monkeypatch):
    """Buckets that "compile" to the eager step, run on the bucket's static buffers."""
    use_doubles(monkeypatch, released=True)


def record_steps(llm: LLM) -> list[tuple[int, int, bool]]:
    """Per pure-decode step run in a bucket: (rows, drafting sequences, whether a sequence did not draft)."""
    runner, graphs = llm.engine.runner, llm.engine.runner.decode_graphs
    steps, forward = [], runner.forward

    def recording(batch):
        before = graphs.steps_run
        logits = forward(batch)
        if graphs.steps_run > before:
            drafting = sum(1 for d in batch.drafts if d)
            steps.append((len(batch.input_ids), drafting, drafting < len(batch.seqs)))
        return logits

    runner.forward = recording
    return steps


def test_decode_rows_give_each_draft_its_own_causal_context():
    seqs = []
    for i, (length, table) in enumerate(((6, [7, 2]), (3, [5]), (8, [1, 4, 9]))):
        seq = Sequence(i, str(i), list(range(100, 100 + length)), SamplingParams(temperature=0))
        seq.block_table, seq.num_computed_tokens = table, length - 1
        seqs.append(seq)
    # sequence 0 verifies 2 drafts (its rows cross into block 2's second slot), 1 none, 2 three
    scheduled = [ScheduledSeq(seqs[0], 3, [50, 51]), ScheduledSeq(seqs[1], 1), ScheduledSeq(seqs[2], 4, [60, 61, 62])]
    tables = np.array([[7, 2, 0], [5, 0, 0], [1, 4, 9]], dtype=np.int32)
    rows = decode_rows(scheduled, [s.seq.num_computed_tokens for s in scheduled], tables, BS)
    assert rows.token_ids == [105, 50, 51, 102, 107, 60, 61, 62]
    assert rows.positions.tolist() == [5, 6, 7, 2, 7, 8, 9, 10]
    assert rows.seq_lens.tolist() == [6, 7, 8, 3, 8, 9, 10, 11]  # row j sees its own position and before
    assert rows.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4 + 2, 4 * 4 + 3, 9 * 4, 9 * 4 + 1,
                                          9 * 4 + 2]
    assert rows.block_tables.tolist() == [tables[0].tolist()] * 3 + [tables[1].tolist()] + [tables[2].tolist()] * 4
    # no drafts: one row, as before
    plain = decode_rows([ScheduledSeq(seqs[1], 1)], [seqs[1].num_computed_tokens], tables[1:2], BS)
    assert (plain.token_ids, plain.positions.tolist(), plain.seq_lens.tolist()) == ([102], [2], [3])


def test_buckets_cover_the_largest_verification_step():
    config = types.SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=2048, speculative_config=None)
    assert max_decode_rows(config) == 4
    config.speculative_config = {"method": "ngram", "num_speculative_tokens": 3}
    assert max_decode_rows(config) == 16  # 4 drafting sequences x (1 + 3) rows
    config.speculative_config["disable_by_batch_size"] = 2
    assert max_decode_rows(config) == 8
    config.max_num_batched_tokens = 6
    assert max_decode_rows(config) == 6  # the token budget caps the drafts


def bucketed_llm(path, spec: dict) -> LLM:
    """Up to 4 sequences of 1 + 3 rows: buckets 1, 2, 4, 8, 16, each its eager forward (``eager_buckets``)."""
    llm = LLM(path, num_kv_blocks=96, block_size=BS, max_num_seqs=4, compile="on", warm_up_in_background=False,
              speculative_config={"num_speculative_tokens": 3, "disable_by_batch_size": 64, **spec})
    assert sorted(llm.engine.runner.decode_graphs.steps) == [1, 2, 4, 8, 16]
    return llm


@pytest.mark.parametrize("arch", ["llama", "glm_moe_dsa"])
def test_verification_in_buckets_equals_transformers(tiny_models, eager_buckets, arch):
    """Llama with drafts right and wrong for two of the prompts (the other two never draft); GLM-5
    (MLA, DSA indexer) with its MTP layer drafting."""
    path = tiny_models(arch, mtp=True) if arch != "llama" else tiny_models(arch)
    reference = Reference(path)
    llm = bucketed_llm(path, {"method": "ngram" if arch == "llama" else "mtp"})
    graphs = llm.engine.runner.decode_graphs
    if arch == "llama":
        llm.engine.proposer = PartialOracle({tuple(p): reference.generate(p) for p in PROMPTS[:2]}, 3, 0.3)
    steps = record_steps(llm)
    check_against_reference(llm, reference, PROMPTS)
    assert graphs.verify_runs.total() > 0 and graphs.verify_runs.total() == sum(1 for s in steps if s[1])
    assert max(rows for rows, _, _ in steps) > 4  # more rows than sequences: drafts in the bucket
    stats = llm.engine.stats().spec_decode
    assert stats.num_draft_tokens > 0  # a random MTP layer's drafts are seldom accepted: exact all the same
    if arch == "llama":
        assert any(drafting and mixed for _, drafting, mixed in steps)  # drafting beside non-drafting
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_mtp_buckets_mixing_drafted_and_ineligible_sequences_are_exact(tiny_models, eager_buckets):
    """DeepSeek-V3 with MTP: a request with a penalty is never drafted for
    (engines/speculative/eligibility.py), so its rows share buckets with drafted ones; the drafted
    outputs equal transformers and the penalised one the engine without speculation."""
    path = tiny_models("deepseek_v3", mtp=True)
    reference = Reference(path)
    penalised = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, presence_penalty=0.5)
    want = LLM(path, num_kv_blocks=16, block_size=BS).generate([PROMPTS[1]], penalised)[0].token_ids
    llm = bucketed_llm(path, {"method": "mtp"})
    steps = record_steps(llm)
    results = llm.generate(PROMPTS, [penalised if i == 1 else GREEDY for i in range(len(PROMPTS))])
    assert results[1].token_ids == want
    for prompt, result in zip(PROMPTS[::2] + PROMPTS[3:], results[::2] + results[3:]):
        assert result.token_ids == reference.generate(prompt)
    assert llm.engine.runner.decode_graphs.verify_runs.total() > 0
    assert any(drafting and mixed for _, drafting, mixed in steps)


def test_a_compiled_bucket_verifies_drafts_equal_to_transformers(tiny_models, monkeypatch):
    """Real inductor (in the compile child), one bucket, the reference decode attention: verification
    steps run compiled and equal transformers."""
    path = tiny_models("llama", num_layers=1, max_position_embeddings=512)
    reference = Reference(path)
    monkeypatch.setattr(xinserve.engines.worker.graphs, "bucket_sizes", lambda max_rows: [8])
    llm = LLM(path, num_kv_blocks=160, block_size=BS, max_num_seqs=2, compile="on", warm_up_in_background=False,
              kernels={"decode_attention": "reference"},
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    graphs = llm.engine.runner.decode_graphs
    assert graphs.states == {8: "compiled"} and graphs.buffers.width == 128, llm.engine.warmup.report()
    prompts = PROMPTS[:2]
    llm.engine.proposer = OracleProposer({tuple(p): reference.generate(p) for p in prompts}, 3, 0.3)
    check_against_reference(llm, reference, prompts)
    assert graphs.verify_runs[8] > 0 and graphs.bucket_runs[8] > 0
