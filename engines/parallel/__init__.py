"""Tensor, pipeline and expert parallelism: the ranks of one replica, how they start and meet, and the step messages rank 0 sends its followers."""
