"""The pooling engine against its references: sentence-transformers' encode() for embeddings, and
transformers' sequence classifier and causal LM for classification and reranker scores (fp32)."""

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from xinserve.engines import LLM
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.pooling.engine_step import add_pooling_request
from xinserve.engines.pooling.model_spec import PoolerSpec
from xinserve.engines.pooling.params import PoolingParams
from xinserve.engines.pooling.pooler import Pooler

TEXTS = [
    "hello world",
    "the harbour fog rolled slowly over the boats and the rocks beyond the breakwater",
    "a",
    "bread " * 12,
    "the librarian believed that every book waited for its reader",
]


def _sentence_transformer(path: Path):
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SentenceTransformer(str(path), device="cpu")


def test_embeddings_equal_sentence_transformers_batched_in_a_tiny_pool(embedding_dir, assert_idle):
    # Inputs of different lengths, 3 each, in one batch: 5 blocks of 8 tokens hold one prompt or two, so
    # the others wait for blocks; with a larger pool the repeats hit the prefix cache (last-token pooling
    # reads only the last row, which is always computed).
    texts = TEXTS * 3
    expected = _sentence_transformer(embedding_dir).encode(texts, convert_to_numpy=True, batch_size=4)
    for num_blocks, budget in ((5, 64), (64, 16)):
        with LLM(str(embedding_dir), num_kv_blocks=num_blocks, block_size=8, max_num_batched_tokens=budget) as llm:
            assert (llm.engine.config.runner, llm.engine.config.convert) == ("pooling", "embed")
            got = np.array(llm.embed(texts))
            assert np.abs(got - expected).max() < 1e-5
            assert (llm.engine.block_manager.prefix_cache_hits > 0) == (num_blocks == 64)
            assert_idle(llm)


def test_mean_pooling_restarts_with_a_preempted_prompt():
    # A preempted prompt is recomputed from position 0: its running sum starts again.
    spec = PoolerSpec("embed", "mean", normalize=False, hidden_size=4)
    pooler = Pooler(spec, model=None, score_token_ids=None)
    seq = Sequence(0, "r", [1, 2, 3, 4], SamplingParams())
    pooler.add(seq, PoolingParams())
    rows = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    pooler.take(seq, 0, rows[:2] + 100)  # the first chunk, then preempted
    pooler.take(seq, 0, rows[:3])
    pooler.take(seq, 3, rows[3:])
    assert pooler.finish([seq], torch.float32) == [rows.mean(dim=0).tolist()]


def test_mean_pooling_equals_sentence_transformers_across_prefill_chunks(mean_embedding_dir, assert_idle):
    expected = _sentence_transformer(mean_embedding_dir).encode(TEXTS, convert_to_numpy=True)
    # 7 tokens a step: every prompt but the shortest is prefilled in chunks and pooled across them.
    with LLM(str(mean_embedding_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=7) as llm:
        assert not llm.engine.block_manager.enable_prefix_caching  # mean reads every row: no prefix hits
        got = np.array(llm.embed(TEXTS + TEXTS[:2]))
        assert np.abs(got[: len(TEXTS)] - expected).max() < 1e-5
        assert np.abs(got[len(TEXTS):] - expected[:2]).max() < 1e-5
        assert np.abs(np.linalg.norm(got, axis=1) - 1).max() > 1e-3  # no Normalize module: not normalized
        assert_idle(llm)


def test_matryoshka_dimensions_truncate_then_normalize(embedding_dir):
    full = _sentence_transformer(embedding_dir).encode(TEXTS, convert_to_numpy=True)
    with LLM(str(embedding_dir), num_kv_blocks=32, block_size=8) as llm:
        got = np.array(llm.embed(TEXTS, dimensions=16))
        expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
        assert got.shape == (len(TEXTS), 16)
        assert np.abs(got - expected).max() < 1e-5
        with pytest.raises(ValueError, match=r"supports dimensions \[16, 32\], got 24"):
            llm.embed(TEXTS[0], dimensions=24)


def test_dimensions_refused_without_matryoshka(mean_embedding_dir):
    with LLM(str(mean_embedding_dir), num_kv_blocks=16, block_size=8) as llm, \
            pytest.raises(ValueError, match="does not support Matryoshka"):
        llm.embed(TEXTS[0], dimensions=8)


def _hf_last_logits(model: torch.nn.Module, tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, -1] if model.config.architectures[0].endswith("CausalLM") \
            else model(input_ids=ids).logits[0]


def test_classify_equals_transformers_sequence_classifier(classifier_dir, assert_idle):
    hf = AutoModelForSequenceClassification.from_pretrained(classifier_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    expected = np.stack([_hf_last_logits(hf, tokenizer, t).softmax(-1).numpy() for t in TEXTS])
    with LLM(str(classifier_dir), num_kv_blocks=32, block_size=8) as llm:
        assert (llm.engine.config.runner, llm.engine.config.convert) == ("pooling", "classify")
        got = np.array(llm.classify(TEXTS))
        assert got.shape == (len(TEXTS), 3)
        assert np.abs(got - expected).max() < 1e-5
        raw = np.array(llm.encode(TEXTS[:1], PoolingParams("classify", activation=False)))
        assert np.abs(raw[0] - _hf_last_logits(hf, tokenizer, TEXTS[0]).numpy()).max() < 1e-5
        assert_idle(llm)


def test_reranker_score_is_p_yes_of_transformers(reranker_dir, assert_idle):
    hf = AutoModelForCausalLM.from_pretrained(reranker_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(reranker_dir)
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    prompts = [f"query: bread\ndocument: {t}\nrelevant:" for t in TEXTS]
    expected = []
    for prompt in prompts:
        logits = _hf_last_logits(hf, tokenizer, prompt)
        expected.append(logits[[no, yes]].softmax(-1)[1].item())  # Qwen3-Reranker's P(yes)
    with LLM(str(reranker_dir), runner="pooling", convert="classify", classifier_from_token="no,yes",
             num_kv_blocks=64, block_size=8) as llm:
        got = [scores[0] for scores in llm.classify(prompts)]
        assert np.abs(np.array(got) - np.array(expected)).max() < 1e-5
        assert_idle(llm)


def test_bad_pooling_requests_are_value_errors(embedding_dir, tiny_models):
    with LLM(str(embedding_dir), num_kv_blocks=4, block_size=8) as llm:
        engine = llm.engine
        with pytest.raises(ValueError, match="empty"):
            add_pooling_request(engine, "a", [], PoolingParams())
        with pytest.raises(ValueError, match="maximum context length is 32 tokens"):
            add_pooling_request(engine, "b", [5] * 33, PoolingParams())
        with pytest.raises(ValueError, match=r"must be in \[0, 1000\)"):
            add_pooling_request(engine, "c", [5, 1000], PoolingParams())
        with pytest.raises(ValueError, match="serves embed, not classify"):
            add_pooling_request(engine, "d", [5], PoolingParams("classify"))
        add_pooling_request(engine, "e", [5] * 32, PoolingParams())  # a whole context is fine: nothing decodes
        assert len(llm.embed([[5, 6, 7]])[0]) == 64
        with pytest.raises(ValueError, match=r"served for pooling \(embed\), not generation"):
            engine.add_request("g", [5], SamplingParams())
    with LLM(str(tiny_models("qwen3")), num_kv_blocks=8) as generating:
        assert generating.engine.config.runner == "generate"
        with pytest.raises(ValueError, match="served for generation"):
            add_pooling_request(generating.engine, "f", [5], PoolingParams())


def test_a_causal_lm_served_for_embeddings_pools_its_last_hidden_state(tiny_models):
    # GTE-Qwen2 / Qwen3-Embedding checkpoints that keep a ForCausalLM architecture: --runner pooling,
    # the LM head left unread, the final norm's last row normalized.
    path = tiny_models("qwen3")
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with LLM(str(path), runner="pooling", num_kv_blocks=32, block_size=8) as llm:
        assert llm.engine.config.convert == "embed"
        got = np.array(llm.embed(TEXTS))
    for row, text in zip(got, TEXTS):
        with torch.no_grad():
            last = hf(**tokenizer(text, return_tensors="pt")).last_hidden_state[0, -1]
        assert np.abs(row - torch.nn.functional.normalize(last, dim=0).numpy()).max() < 1e-5


def test_a_pooling_runner_is_one_rank_for_now(embedding_dir):
    with pytest.raises(ValueError, match="built for one rank"):
        LLM(str(embedding_dir), tensor_parallel_size=2)
