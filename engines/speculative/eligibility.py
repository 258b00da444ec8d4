"""Which sequences may be drafted for: those whose next tokens' distributions depend only on the
tokens before them, so that verifying k drafts in one step is exactly k + 1 ordinary steps. No torch.

Not drafted (they decode one token per step, as without speculation): penalties (each position's
logits would need the drafts before it in the counts), structured output (the grammar state would
have to advance over unverified drafts), and outputs still short of ``min_tokens`` (EOS suppressed
per position). Logprobs, logit bias, seeds, top-k / top-p / min-p, n > 1 and stop strings all
speculate: the detokenizer takes a step's accepted tokens one by one and the output ends at the token
that completes a stop string (``IncrementalDetokenizer.add_each``), as it would one token per step.
"""

from xinserve.engines.core.sequence import Sequence


def may_draft(seq: Sequence) -> bool:
    p = seq.params
    return (
        not p.has_penalties and seq.grammar is None and seq.waiting_grammar is None
        and p.json_schema is None and seq.num_output_tokens >= p.min_tokens
    )
