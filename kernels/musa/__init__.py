"""Moore Threads GPU kernels through torch_musa (and MATE)."""
