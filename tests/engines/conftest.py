"""Helpers shared by the engine tests."""

from collections.abc import Callable

import pytest

from xinserve.engines import LLM


@pytest.fixture
def assert_idle() -> Callable[[LLM], None]:
    """Checks that ``llm`` holds no request and every KV block is free again."""

    def check(llm: LLM) -> None:
        engine = llm.engine
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert not engine.requests and not engine.has_unfinished_requests()

    return check
