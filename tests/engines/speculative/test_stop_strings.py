"""Stop strings under speculative decoding: a request with stop strings is drafted for, its accepted
tokens are checked one by one, and the output (tokens, text, finish reason) ends where it ends one token
per step."""

from tests.engines.speculative.doubles import OracleProposer, TableProposer
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.core.detokenizer import IncrementalDetokenizer


def test_the_detokenizer_ends_a_multi_token_add_at_the_stop_strings_token(tiny_model_dir):
    tokenizer = LLM(tiny_model_dir, num_kv_blocks=8).tokenizer
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    stop = tokenizer.decode(ids[:3])[-3:]  # ends inside the third token's text
    detok = IncrementalDetokenizer(tokenizer, [], [stop])
    text, stopped, kept = detok.add_each(ids)
    assert stopped and kept == 3
    one_by_one = IncrementalDetokenizer(tokenizer, [], [stop])
    assert "".join(one_by_one.add([t])[0] for t in ids[:3]) == text == detok.text


def test_drafted_requests_with_stop_strings_stop_where_one_token_per_step_does(tiny_model_dir):
    prompts = [[5, 61, 200, 17, 44], [90, 12, 7, 300, 8, 150], [33, 34, 35, 36]]
    plain = LLM(tiny_model_dir, num_kv_blocks=64, block_size=4)
    unstopped = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    # stop strings that end at several places of each output: mid-step for drafts of 3
    stops = [[r.text[len(r.text) * n // 10 : len(r.text) * n // 10 + 2]] for r, n in zip(unstopped, (3, 5, 7))]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stop) for stop in stops]
    expected = plain.generate(prompts, params)
    assert all(r.finish_reason == "stop" and len(r.token_ids) < 16 for r in expected)
    spec = LLM(tiny_model_dir, num_kv_blocks=64, block_size=4,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    spec.engine.proposer = OracleProposer({tuple(p): r.token_ids for p, r in zip(prompts, unstopped)}, k=3)
    got = spec.generate(prompts, params)
    assert [(r.token_ids, r.text, r.finish_reason) for r in got] == \
        [(r.token_ids, r.text, r.finish_reason) for r in expected]
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_generation_tokens_total_counts_only_the_tokens_emitted_before_a_stop_string(tiny_models):
    """A speculative step accepts several tokens at once; the ones after the token that completes a stop
    string are never emitted, and ``generation_tokens_total`` does not count them."""
    path = tiny_models("llama")
    prompt = [5, 9, 14, 200, 31, 7]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(path, num_kv_blocks=64, block_size=4) as plain:
        tokens = plain.generate([prompt], params)[0].token_ids
        first = plain.tokenizer.decode(tokens[:1])
        stop = plain.tokenizer.decode(tokens[:2])[len(first):]  # the second token's text
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64}
    with LLM(path, num_kv_blocks=64, block_size=4, speculative_config=spec) as llm:
        llm.engine.proposer = TableProposer({tuple(tokens[:1]): tokens[1:5]})  # all right: 5 tokens in one step
        params.stop = [stop]
        out = llm.generate([prompt], params)[0]
        assert out.finish_reason == "stop" and len(out.token_ids) <= 2
        assert llm.engine.stats().spec_decode.num_accepted_tokens == 4
        assert llm.engine.stats().generation_tokens_total == len(out.token_ids)
