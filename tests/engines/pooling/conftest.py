"""The tiny pooling models (tests/engines/pooling/model_dirs.py), built once per session."""

from pathlib import Path

import pytest

from tests.engines.pooling.model_dirs import make_classifier, make_embedding_model, make_reranker


@pytest.fixture(scope="session")
def embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Last-token pooling + Normalize (Qwen3-Embedding's recipe), Matryoshka: dimensions 16 and 32."""
    return make_embedding_model(tmp_path_factory.mktemp("embed"), matryoshka=[16, 32])


@pytest.fixture(scope="session")
def mean_embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_embedding_model(tmp_path_factory.mktemp("embed-mean"), pooling="mean", normalize=False)


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_classifier(tmp_path_factory.mktemp("classifier"))


@pytest.fixture(scope="session")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_reranker(tmp_path_factory.mktemp("reranker"))
