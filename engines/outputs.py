"""What the engine hands back: per-step deltas (for streaming) and finished results (offline)."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one generated token and its top alternatives (raw model distribution)."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class StepOutput:
    """New tokens of one sequence from one engine step. ``index`` is the choice index (n > 1)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One finished choice of a request."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A finished request from ``LLM.generate``; the top-level fields mirror ``outputs[0]``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
