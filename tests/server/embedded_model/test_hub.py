"""Hub ids fail fast with advice when they are not cached and the Hub cannot be reached."""

import time

import pytest

from xinserve.server.embedded_model.hub import local_path, local_snapshot, looks_like_hub_id


def test_what_counts_as_a_hub_id(tmp_path):
    assert looks_like_hub_id("Qwen/Qwen2.5-0.5B")
    assert not looks_like_hub_id("/data/models/qwen")
    assert not looks_like_hub_id("./qwen")
    assert not looks_like_hub_id("a/b/c")
    assert local_path(str(tmp_path)) == str(tmp_path)


def test_offline_and_uncached_is_refused_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set: download it"):
        local_snapshot("Qwen/Qwen2.5-0.5B")


def test_unreachable_hub_fails_within_seconds(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    start = time.monotonic()
    with pytest.raises(ValueError, match="Hub cannot be reached"):
        local_snapshot("Qwen/Qwen2.5-0.5B")
    assert time.monotonic() - start < 15
