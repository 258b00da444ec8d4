"""The KV connector seam (engines/kv/connector.py) as the scheduler drives it, with a recording connector:
tokens it claims at admission are loaded, not computed; blocks it holds after a request ends stay out
of the free pool until it says they were read."""

from xinserve.engines.core.kv_cache import BlockManager
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.scheduler import SampledTokens, Scheduler
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.kv.connector import KVConnectorBase


class RecordingConnector(KVConnectorBase):
    """Claims every prompt token but the last for requests with kv_transfer_params; holds their blocks."""

    def __init__(self) -> None:
        self.allocated: list[tuple[str, list[int], int]] = []
        self.sent: set[str] = set()

    def get_num_new_matched_tokens(self, seq: Sequence, computed: list[int]) -> int:
        if seq.params.kv_transfer_params is None or any(r == seq.request_id for r, _, _ in self.allocated):
            return 0
        return seq.num_prompt_tokens - 1 - len(computed) * self.block_manager.block_size

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        self.allocated.append((seq.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self) -> list:
        return []

    def start_load_kv(self, meta: list) -> None:
        raise AssertionError("the scheduler never runs the worker side")

    def request_finished(self, seq: Sequence, reason: str) -> tuple[bool, dict | None]:
        if seq.params.kv_transfer_params is None or reason != "length":
            return False, None
        return True, {"remote_block_ids": list(seq.block_table)}

    def finished_sending(self) -> set[str]:
        sent, self.sent = self.sent, set()
        return sent


def make(connector: RecordingConnector) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks=16, block_size=4)
    connector.bind_block_manager(bm)
    return Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, kv_connector=connector), bm


def test_tokens_the_connector_claims_are_loaded_and_only_the_last_prompt_token_is_computed():
    connector = RecordingConnector()
    sched, _ = make(connector)
    seq = Sequence(0, "d", list(range(1, 11)), SamplingParams(max_tokens=2, kv_transfer_params={}))
    sched.add(seq)
    (step,) = sched.schedule()
    assert step.num_new_tokens == 1 and seq.num_computed_tokens == 9
    assert connector.allocated == [("d", seq.block_table, 9)]  # 3 blocks: the last one partly loaded
    sched.update([step], [SampledTokens(seq, [42])])
    assert sched.prompt_tokens_computed == 1
    assert sched.block_manager.external_hits == 9


def test_a_plain_request_computes_its_whole_prompt():
    sched, _ = make(RecordingConnector())
    seq = Sequence(0, "p", list(range(1, 11)), SamplingParams(max_tokens=2))
    sched.add(seq)
    (step,) = sched.schedule()
    sched.update([step], [SampledTokens(seq, [42])])
    assert step.num_new_tokens == 10 and sched.prompt_tokens_computed == 10


def test_held_blocks_stay_used_until_the_connector_reports_them_sent():
    connector = RecordingConnector()
    sched, bm = make(connector)
    seq = Sequence(0, "p", list(range(1, 11)), SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    connector.allocated.append(("p", [], 0))  # this one is a prefill: nothing to load
    sched.add(seq)
    (step,) = sched.schedule()
    result = sched.update([step], [SampledTokens(seq, [42])])
    (out,) = result.outputs
    held = sched.held_blocks["p"]
    assert out.finish_reason == "length" and out.kv_transfer_params == {"remote_block_ids": held}
    assert len(held) == 3 and bm.num_free_blocks == 13
    sched.release_sent_blocks()
    assert bm.num_free_blocks == 13  # not read yet
    connector.sent.add("p")
    sched.release_sent_blocks()
    assert bm.num_free_blocks == 16 and not sched.held_blocks
