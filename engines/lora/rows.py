"""A step's LoRA inputs on the host: each token row's adapter slot, and the (slot, adapter id) pairs the
step's device slots must hold. No torch."""

import numpy as np


def lora_rows(seqs: list, num_new: list[int]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """``seqs`` in row order with their row counts -> (slots [T] int64, -1 for base-model rows; the pairs)."""
    per_seq = np.fromiter((seq.lora_slot for seq in seqs), dtype=np.int64, count=len(seqs))
    pairs = sorted({(seq.lora_slot, seq.lora.adapter_id) for seq in seqs if seq.lora_slot >= 0})
    return np.repeat(per_seq, num_new), pairs
