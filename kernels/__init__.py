"""Kernels the models call: a pure-torch reference for every op (``kernels.reference``), device
implementations (``kernels.triton``, ``kernels.npu``, ``kernels.musa``), and the registry that
probes them on the worker's device at start-up and hands the model what it chose
(``kernels.registry.select`` -> ``KernelSelection.ops``)."""
