"""Scheduler behaviour driven by a fake model: every scheduled token is 'computed' and every
sequence that reaches its end gets token 7."""

from xinserve.engines.core.kv_cache import BlockManager
from xinserve.engines.core.outputs import RequestFailure, StepResult, TokenLogprob
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.scheduler import SampledTokens, Scheduler
from xinserve.engines.core.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, prefix=True, eos=(), max_model_len=None):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(bm, max_num_seqs, budget, eos, max_model_len)


def add(sched: Scheduler, seq_id: int, prompt_len: int, max_tokens: int = 4) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", [seq_id * 1000 + i for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens))
    sched.add(seq)
    return seq


def fake_step(sched: Scheduler) -> list[tuple[Sequence, int]]:
    scheduled = sched.schedule()
    plan = [(s.seq, s.num_new_tokens) for s in scheduled]
    sampled = [SampledTokens(s.seq, [7]) for s in scheduled
               if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens]
    sched.update(scheduled, sampled)
    return plan


def run_all(sched: Scheduler, max_steps: int = 1000) -> int:
    steps = 0
    while sched.has_unfinished():
        fake_step(sched)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def test_long_prompt_is_prefilled_in_chunks_while_others_decode():
    sched = make(budget=8)
    a = add(sched, 1, 3, max_tokens=10)
    fake_step(sched)  # a prefilled
    b = add(sched, 2, 20)
    plan = fake_step(sched)
    assert plan == [(a, 1), (b, 7)]  # a decodes, b takes the rest of the budget
    plan = fake_step(sched)
    assert plan == [(a, 1), (b, 7)]
    plan = fake_step(sched)
    assert plan == [(a, 1), (b, 6)]
    assert b.num_output_tokens == 1


def test_token_budget_and_max_num_seqs_are_respected():
    sched = make(budget=16, max_num_seqs=3)
    for i in range(6):
        add(sched, i, 5)
    while sched.has_unfinished():
        plan = fake_step(sched)
        assert sum(n for _, n in plan) <= 16
        assert len(sched.running) <= 3


def test_new_requests_join_between_steps_and_finished_leave_at_once():
    sched = make()
    a = add(sched, 1, 4, max_tokens=2)
    fake_step(sched)
    b = add(sched, 2, 4, max_tokens=3)
    plan = fake_step(sched)
    assert [s for s, _ in plan] == [a, b]
    assert a.is_finished and a not in sched.running and a.block_table == []
    assert b.status is SequenceStatus.RUNNING


def test_preemption_recomputes_the_newest_and_everything_finishes():
    sched = make(num_blocks=6, block_size=4, budget=64)
    seqs = [add(sched, i, 6, max_tokens=8) for i in range(3)]
    run_all(sched)
    assert sched.num_preemptions > 0
    assert all(s.is_finished and s.num_output_tokens == 8 for s in seqs)
    assert sched.block_manager.num_free_blocks == 6


def test_preempted_sequence_is_the_newest_running_one():
    sched = make(num_blocks=4, block_size=2, budget=64)
    old = add(sched, 1, 4, max_tokens=20)
    new = add(sched, 2, 4, max_tokens=20)
    fake_step(sched)  # both prefilled: 2 blocks each, pool full
    plan = fake_step(sched)  # both need a third block: the newest goes
    assert [s for s, _ in plan] == [old]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert sched.waiting[0] is new


def test_fcfs_admission_stops_at_the_first_that_does_not_fit():
    sched = make(num_blocks=4, block_size=4, budget=64)
    add(sched, 1, 12, max_tokens=1)
    big = add(sched, 2, 8, max_tokens=1)
    small = add(sched, 3, 2, max_tokens=1)
    plan = fake_step(sched)
    assert [s.seq_id for s, _ in plan] == [1]
    assert list(sched.waiting) == [big, small]


def test_prefix_cache_hit_skips_computed_tokens():
    sched = make(block_size=4)
    a = add(sched, 1, 9, max_tokens=1)
    run_all(sched)
    b = Sequence(9, "r9", a.prompt_token_ids[:8] + [5, 6, 7], SamplingParams(max_tokens=1))
    sched.add(b)
    plan = fake_step(sched)
    assert plan == [(b, 3)]
    assert sched.block_manager.prefix_cache_hits == 8


def test_n_choices_wait_for_the_parent_prompt_then_share_it():
    sched = make(block_size=4, budget=6, prefix=False)
    parent = add(sched, 1, 10, max_tokens=5)
    child = Sequence(2, "r1", parent.prompt_token_ids, parent.params, index=1, parent=parent)
    sched.add(child)
    plan = fake_step(sched)
    assert plan == [(parent, 6)]  # the child waits while the parent's prompt is incomplete
    plan = fake_step(sched)
    assert plan == [(parent, 4)]
    plan = fake_step(sched)
    assert plan == [(parent, 1), (child, 2)]  # child shares 2 full prompt blocks, computes 2 tokens
    assert child.block_table[:2] == parent.block_table[:2]
    run_all(sched)
    assert sched.block_manager.num_free_blocks == 64


def test_update_computes_the_scheduled_tokens_and_caches_their_full_blocks():
    sched = make(block_size=4, budget=6)
    seq = add(sched, 1, 10, max_tokens=3)
    scheduled = sched.schedule()  # a chunk of 6: no token sampled yet
    assert sched.update(scheduled, []) == StepResult()
    assert seq.num_computed_tokens == 6 and seq.num_output_tokens == 0
    assert sched.block_manager.computed_blocks(Sequence(2, "r2", seq.prompt_token_ids, seq.params)) != []
    scheduled = sched.schedule()
    [out] = sched.update(scheduled, [SampledTokens(seq, [5])]).outputs
    assert seq.num_computed_tokens == 10 and seq.token_ids[-1] == 5
    assert (out.request_id, out.index, out.new_token_ids, out.finished) == ("r1", 0, [5], False)


def test_update_stops_on_eos_stop_tokens_and_length():
    sched = make(eos=[2], max_model_len=14)
    params = {
        "eos": SamplingParams(max_tokens=5),
        "ignore": SamplingParams(max_tokens=5, ignore_eos=True),
        "stop_id": SamplingParams(max_tokens=5, stop_token_ids=[9]),
        "max_tokens": SamplingParams(max_tokens=1),
        "context": SamplingParams(max_tokens=50),
    }
    seqs = {}
    for i, (name, p) in enumerate(params.items()):
        seqs[name] = Sequence(i, name, [100 + i] * (13 if name == "context" else 4), p)
        sched.add(seqs[name])
    scheduled = sched.schedule()
    tokens = {"eos": 2, "ignore": 2, "stop_id": 9, "max_tokens": 6, "context": 6}
    outs = sched.update(scheduled, [SampledTokens(seqs[n], [t]) for n, t in tokens.items()]).outputs
    assert {o.request_id: o.finish_reason for o in outs} == {
        "eos": "stop", "ignore": None, "stop_id": "stop", "max_tokens": "length", "context": "length"}
    assert sched.running == [seqs["ignore"]]
    assert all(seqs[n].block_table == [] for n in tokens if n != "ignore")


def test_update_takes_several_tokens_up_to_the_first_that_stops():
    """The seam a speculative step uses: the tokens after a stop are not taken, nor their log-probs."""
    sched = make(eos=[2])
    seq = add(sched, 1, 4, max_tokens=10)
    lps = [TokenLogprob(-0.1 * i, [], []) for i in range(4)]
    scheduled = sched.schedule()
    [out] = sched.update(scheduled, [SampledTokens(seq, [5, 6, 2, 8], lps)]).outputs
    assert out.new_token_ids == [5, 6, 2] and out.logprobs == lps[:3]
    assert (out.finished, out.finish_reason) == (True, "stop")
    assert seq.output_token_ids == [5, 6, 2] and seq.is_finished


class _Matcher:
    def __init__(self, allowed: set[int]) -> None:
        self.allowed, self.accepted = allowed, []

    def accept_token(self, token: int) -> bool:
        self.accepted.append(token)
        return token in self.allowed


class _Grammar:
    def __init__(self, allowed: set[int]) -> None:
        self.matcher = _Matcher(allowed)


def test_update_advances_the_grammar_and_fails_a_token_outside_it():
    sched = make(eos=[2])
    waits = add(sched, 1, 4, max_tokens=10)
    waits.params.json_schema_after_token = 6
    waits.waiting_grammar = _Grammar({3})
    bad = add(sched, 2, 4, max_tokens=10)
    bad.grammar = _Grammar({3})
    ends = add(sched, 3, 4, max_tokens=10)
    ends.params = SamplingParams(max_tokens=10, ignore_eos=True)
    ends.grammar = _Grammar({2})
    scheduled = sched.schedule()
    result = sched.update(scheduled, [SampledTokens(waits, [5, 6]), SampledTokens(bad, [4]), SampledTokens(ends, [2])])
    assert waits.grammar is not None and waits.waiting_grammar is None and waits.grammar.matcher.accepted == []
    assert [(o.request_id, o.finish_reason) for o in result.outputs] == [("r1", None), ("r3", "stop")]
    assert result.failures == [RequestFailure("r2", "token 4 is outside the output's grammar")]
    assert (bad.is_finished, bad.finish_reason, bad.block_table) == (True, "abort", [])
    assert ends.grammar.matcher.accepted == [2]
