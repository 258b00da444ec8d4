"""Pools a prompt's hidden states into its output, across the chunks its prefill runs in.

Last-token pooling reads the row of the prompt's last token; mean and CLS read every row (the
engine turns prefix-cache hits off for them, so each row is computed), summed or kept as the
chunks arrive and reset when a preempted prompt starts again from its first token.
"""

import torch
import torch.nn.functional as F

from xinserve.engines.core.sequence import Sequence
from xinserve.engines.pooling.model_spec import PoolerSpec
from xinserve.engines.pooling.params import PoolingParams


class Pooler:
    def __init__(self, spec: PoolerSpec, model: torch.nn.Module, score_token_ids: tuple[int, int] | None) -> None:
        self.spec = spec
        self.model = model  # its compute_logits: the classifier's score head, or a reranker's LM head
        self.score_token_ids = score_token_ids  # (false, true)
        self.params: dict[int, tuple[Sequence, PoolingParams]] = {}  # seq_id -> it, what its request asked for
        self._state: dict[int, tuple[torch.Tensor, int]] = {}  # seq_id -> (sum or row [hidden] float32, rows)

    def add(self, seq: Sequence, params: PoolingParams) -> None:
        self.params[seq.seq_id] = (seq, params)

    def drop_finished(self) -> None:
        """Forget the sequences finished without an output (aborted)."""
        for seq, _ in [entry for entry in self.params.values() if entry[0].is_finished]:
            self.release(seq)

    def release(self, seq: Sequence) -> None:
        self.params.pop(seq.seq_id, None)
        self._state.pop(seq.seq_id, None)

    def take(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """``rows``: [n, hidden], the hidden states of positions ``start`` .. ``start + n - 1``."""
        method = self.spec.method
        if method == "lasttoken":
            if start + rows.shape[0] == seq.num_tokens:
                self._state[seq.seq_id] = (rows[-1].float(), 1)
        elif method == "cls":
            if start == 0:
                self._state[seq.seq_id] = (rows[0].float(), 1)
        else:  # mean: a running sum, restarted with the first position (a preempted prompt recomputed)
            total, count = (torch.zeros_like(rows[0], dtype=torch.float32), 0) if start == 0 \
                else self._state[seq.seq_id]
            self._state[seq.seq_id] = (total + rows.float().sum(dim=0), count + rows.shape[0])

    def finish(self, seqs: list[Sequence], dtype: torch.dtype) -> list[list[float]]:
        """The outputs of ``seqs``, whose prompts were computed to their end: an embedding, or one value
        per label (a reranker: its one score)."""
        if not seqs:
            return []
        pooled = []
        for seq in seqs:
            total, count = self._state.pop(seq.seq_id)
            pooled.append(total / count)
        hidden = torch.stack(pooled)  # [N, hidden] float32
        params = [self.params[seq.seq_id][1] for seq in seqs]
        if self.spec.task == "embed":
            return [self._embedding(row, p) for row, p in zip(hidden, params)]
        # The head runs in the model's dtype, on the pooled rows as the model computed them.
        logits = self.model.compute_logits(hidden.to(dtype))  # [N, labels or vocab] float32
        if self.score_token_ids is not None:
            false_id, true_id = self.score_token_ids
            logits = (logits[:, true_id] - logits[:, false_id]).unsqueeze(1)  # [N, 1]
        return [_activate(row, p.activation).tolist() for row, p in zip(logits, params)]

    def _embedding(self, row: torch.Tensor, params: PoolingParams) -> list[float]:
        """Matryoshka: the first ``dimensions`` values, normalized again (when the embedding is)."""
        if params.dimensions is not None:
            row = row[: params.dimensions]
        normalize = self.spec.normalize if params.normalize is None else params.normalize
        return (F.normalize(row, dim=0) if normalize else row).tolist()


def _activate(logits: torch.Tensor, activation: bool) -> torch.Tensor:
    """[labels] -> probabilities: a sigmoid for one label (a score), else a softmax."""
    if not activation:
        return logits
    return logits.sigmoid() if logits.shape[0] == 1 else logits.softmax(dim=0)
