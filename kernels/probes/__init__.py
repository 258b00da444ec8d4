"""Probes and timings: each candidate kernel checked against the reference on the worker's device, then timed at the model's shapes."""
