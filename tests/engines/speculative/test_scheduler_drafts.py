"""The scheduler with draft tokens, torch-free: 1 + k rows in the budget, only accepted drafts computed,
rejected drafts' empty blocks freed, unverified tokens never in the prefix cache."""

from xinserve.engines.core.kv_cache import BlockManager
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.scheduler import SampledTokens, Scheduler
from xinserve.engines.core.sequence import Sequence


def make(num_blocks=64, block_size=4, budget=32, max_model_len=None):
    return Scheduler(BlockManager(num_blocks, block_size, True), 8, budget, (), max_model_len)


def decoding(sched: Scheduler, prompt: list[int], max_tokens: int = 20) -> Sequence:
    """A sequence whose prompt is computed and whose first token (5) is sampled: about to decode."""
    seq = Sequence(0, "r0", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    sched.add(seq)
    scheduled = sched.schedule()
    sched.update(scheduled, [SampledTokens(seq, [5])])
    assert seq.num_tokens - seq.num_computed_tokens == 1
    return seq


def test_a_drafted_sequence_takes_one_row_per_draft_plus_its_token():
    sched = make()
    seq = decoding(sched, list(range(10, 16)))
    seq.draft_token_ids = [1, 2, 3]
    [step] = sched.schedule()
    assert (step.num_new_tokens, step.draft_token_ids) == (4, [1, 2, 3])
    assert len(seq.block_table) == sched.block_manager.blocks_needed(seq.num_tokens + 3)


def test_the_budget_counts_drafts_and_cuts_them():
    sched = make(budget=3)
    seq = decoding(sched, [10, 11])
    seq.draft_token_ids = [1, 2, 3, 4]
    [step] = sched.schedule()
    assert (step.num_new_tokens, step.draft_token_ids) == (3, [1, 2])


def test_drafts_stop_at_max_tokens_and_the_context():
    sched = make(max_model_len=10)
    seq = decoding(sched, list(range(10, 17)), max_tokens=3)  # 8 tokens, 1 output
    seq.draft_token_ids = [1, 2, 3, 4]
    [step] = sched.schedule()
    assert step.draft_token_ids == [1]  # max_tokens 3: the token, one draft, then the bonus token
    sched = make(max_model_len=10)
    seq = decoding(sched, list(range(10, 17)))
    seq.draft_token_ids = [1, 2, 3, 4]
    [step] = sched.schedule()
    assert step.draft_token_ids == [1, 2]  # positions 8 and 9 are the last in a 10-token context


def test_rejected_drafts_are_not_computed_and_their_empty_blocks_are_freed():
    sched = make(block_size=4)
    seq = decoding(sched, [10, 11, 12])  # 4 tokens, 3 computed: one block
    free_before = sched.block_manager.num_free_blocks
    seq.draft_token_ids = [1, 2, 3, 4, 5, 6]  # rows at positions 3..9: three blocks
    scheduled = sched.schedule()
    assert len(seq.block_table) == 3
    [out] = sched.update(scheduled, [SampledTokens(seq, [1, 9])]).outputs  # draft 1 accepted, then 9
    assert out.new_token_ids == [1, 9]
    assert seq.token_ids[-3:] == [5, 1, 9]
    assert seq.num_computed_tokens == 5  # the prompt, 5 and the accepted 1; 9 is computed next step
    assert len(seq.block_table) == 2  # the block of positions 8..11 held only rejected drafts
    assert sched.block_manager.num_free_blocks == free_before - 1
    assert seq.draft_token_ids == []
    assert (sched.spec_stats.num_drafts, sched.spec_stats.num_draft_tokens) == (1, 6)
    assert (sched.spec_stats.num_accepted_tokens, sched.spec_stats.accepted_per_position) == (1, [1, 0, 0, 0, 0, 0])


def test_the_prefix_cache_holds_only_verified_tokens():
    sched = make(block_size=4)
    seq = decoding(sched, [10, 11, 12])  # tokens 10 11 12 5
    seq.draft_token_ids = [1, 2, 3, 4]  # positions 3..7 fill the second block, all unverified
    scheduled = sched.schedule()
    sched.update(scheduled, [SampledTokens(seq, [8])])  # the first draft rejected: 8 instead
    bm = sched.block_manager
    assert seq.num_computed_tokens == 4
    assert [bm.blocks[b].token_ids for b in seq.block_table] == [(10, 11, 12, 5)]
    seq.draft_token_ids = [6, 7, 8]
    scheduled = sched.schedule()
    sched.update(scheduled, [SampledTokens(seq, [6, 7, 8, 9])])  # every draft accepted
    assert seq.num_computed_tokens == 8
    assert [bm.blocks[b].token_ids for b in seq.block_table] == [(10, 11, 12, 5), (8, 6, 7, 8)]


def test_a_stop_token_among_accepted_drafts_ends_the_sequence_there():
    sched = make()
    seq = decoding(sched, [10, 11, 12])
    seq.params.stop_token_ids = [2]
    seq.draft_token_ids = [1, 2, 3]
    scheduled = sched.schedule()
    [out] = sched.update(scheduled, [SampledTokens(seq, [1, 2, 3, 4])]).outputs
    assert (out.new_token_ids, out.finish_reason) == ([1, 2], "stop")
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_drafts_that_do_not_fit_are_dropped_before_anyone_is_preempted():
    sched = make(num_blocks=2, block_size=4)
    seq = decoding(sched, [10, 11, 12])  # one block of two
    seq.draft_token_ids = list(range(1, 9))  # would need three blocks
    [step] = sched.schedule()
    assert (step.num_new_tokens, step.draft_token_ids) == (1, [])
    assert sched.num_preemptions == 0


def test_drafts_never_take_the_block_a_later_sequence_needs():
    sched = make(num_blocks=3, block_size=4)
    a = Sequence(0, "a", [10, 11, 12], SamplingParams(temperature=0, max_tokens=20))
    b = Sequence(1, "b", [20, 21, 22, 23], SamplingParams(temperature=0, max_tokens=20))
    sched.add(a)
    sched.add(b)
    scheduled = sched.schedule()
    sched.update(scheduled, [SampledTokens(a, [5]), SampledTokens(b, [6])])
    assert sched.block_manager.num_free_blocks == 1  # b's next token needs it
    a.draft_token_ids = [1, 2, 3]  # would need it too
    plan = [(s.seq, s.num_new_tokens) for s in sched.schedule()]
    assert plan == [(a, 1), (b, 1)] and sched.num_preemptions == 0
