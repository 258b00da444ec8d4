"""Quantized checkpoints: which format a checkpoint is in (formats/), the on-the-fly quantization of a
float checkpoint (online.py), and the modules that hold quantized weights and call the ``quant_linear``
/ ``quant_fused_moe`` kernels (linear.py, experts.py, install.py). Every format is read into the one
layout of kernels/quantized_weight.py."""
