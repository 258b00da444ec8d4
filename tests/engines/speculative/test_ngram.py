"""Prompt lookup: the longest suffix n-gram, its latest earlier match, what followed it."""

from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.speculative.config import SpeculativeConfig
from xinserve.engines.speculative.ngram import NgramProposer, propose_ngram


def test_the_tokens_after_the_latest_match_of_the_longest_suffix():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [7, 8, 2]  # "8 2 3" never occurred before; "2 3" last at 5
    assert propose_ngram(tokens, 3, 3, 3) == []
    assert propose_ngram([5, 6, 5, 6, 5], 4, 1, 2) == [6, 5]  # "6 5" last seen at 1: then 6, 5 (the end)


def test_a_longer_match_wins_over_a_later_shorter_one():
    tokens = [4, 1, 2, 3, 0, 2, 3, 5, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [0, 2]  # "1 2 3" at 1 beats "2 3" at 5
    assert propose_ngram(tokens, 2, 1, 2) == [5, 1]


def test_no_match_and_too_short_sequences_propose_nothing():
    assert propose_ngram([1, 2, 3, 4], 3, 1, 4) == []
    assert propose_ngram([7], 3, 1, 4) == []


def seq(tokens, computed, **params):
    s = Sequence(0, "r", tokens, SamplingParams(**params))
    s.num_computed_tokens = computed
    return s


def test_the_proposer_drafts_only_for_eligible_decoding_sequences():
    proposer = NgramProposer(SpeculativeConfig("ngram", 2, 1, 2, disable_by_batch_size=4))
    tokens = [1, 2, 1, 2, 1]
    plain, prefilling = seq(tokens, 4), seq(tokens, 2)
    penalised, stop = seq(tokens, 4, presence_penalty=0.5), seq(tokens, 4, stop=["x"])
    short = seq(tokens, 4, min_tokens=1)
    proposer.propose([plain, prefilling, penalised, stop, short])  # five running: more than 4
    assert plain.draft_token_ids == []
    proposer.propose([plain, prefilling, penalised, stop])
    assert plain.draft_token_ids == stop.draft_token_ids == [2, 1]  # stop strings are checked per token
    assert [s.draft_token_ids for s in (prefilling, penalised, short)] == [[], [], []]
