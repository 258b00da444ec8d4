"""How a mixture-of-experts layer turns each token's router logits into its experts and their weights.

One record per model, shared by the model (which passes it to ``select_experts``), the kernel probes
(which build routing inputs from it) and the implementations' ``unsupported`` checks (a vendor
gating operator supports some of these settings only).
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MoeRouting:
    """Scores are ``scoring(logits)`` over all experts; the top ``top_k`` experts are chosen by the
    scores (plus a learned per-expert bias when ``correction_bias``: GLM-4.5's
    ``e_score_correction_bias``, which steers the choice but not the weights), among the experts of
    the best ``topk_groups`` of ``num_groups`` equal groups (a group ranks by the sum of its two best
    biased scores). The weights are the chosen experts' unbiased scores, divided by their sum when
    ``renormalize``, times ``scaling_factor``."""

    top_k: int
    scoring: str = "softmax"  # or "sigmoid"
    renormalize: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    correction_bias: bool = False
    scaling_factor: float = 1.0
