"""One generated sequence: its tokens, KV blocks and progress. Plain Python, no torch."""

from enum import Enum, auto
from typing import Any

from xinserve.engines.core.outputs import FinishReason
from xinserve.engines.core.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A prompt plus the tokens generated after it.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the scheduler makes it catch up
    with ``num_tokens`` (there is no separate prefill phase). ``parent`` is set on the extra choices
    of an ``n > 1`` request: they wait for the parent's prompt and share its full prompt blocks.
    ``grammar`` is the matcher of a constrained output, advanced by each accepted token; it stays with
    the sequence through preemption (recomputing the KV accepts no token again). ``waiting_grammar``
    holds it while the output has not yet reached ``params.json_schema_after_token``.
    ``draft_token_ids``: the speculative tokens proposed for the next step (engines/speculative/), not
    yet part of ``token_ids``; the scheduler runs them with the sequence's next token.
    ``lora``: its LoRA adapter (engines/lora/registry.py ``AdapterRef``) or None; ``lora_slot``: the device
    slot the scheduler gave it while it runs (-1: none).
    """

    __slots__ = (
        "arrival_time",
        "block_table",
        "draft_token_ids",
        "finish_reason",
        "grammar",
        "index",
        "lora",
        "lora_slot",
        "num_computed_tokens",
        "num_prompt_tokens",
        "params",
        "parent",
        "request_id",
        "seq_id",
        "status",
        "token_ids",
        "waiting_grammar",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float = 0.0,
        index: int = 0,
        parent: "Sequence | None" = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.parent = parent
        self.grammar: Any = None
        self.waiting_grammar: Any = None
        self.draft_token_ids: list[int] = []
        self.lora: Any = None
        self.lora_slot = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.name})"
        )


def needs_prompt_logits(seq: Sequence) -> bool:
    """Whether the next computed prompt tokens of ``seq`` must yield log-probs (echo with logprobs).

    Asked once per request, of its first choice, and only until its first token: the prompt is then
    done, and a recompute after preemption needs no second copy.
    """
    return seq.params.prompt_logprobs is not None and seq.parent is None and seq.num_output_tokens == 0
