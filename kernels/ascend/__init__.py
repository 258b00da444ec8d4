"""Ascend NPU kernels through torch_npu, with the reference kernels' signatures."""
