"""``lora_slot_bytes`` (what ``xinserve plan`` counts per adapter slot) equals what the slots really take on
a device: every projection's A and B padded to max_lora_rank, the routed experts' on mixture-of-experts layers."""

import pytest
import torch

from xinserve.engines.lora.device_adapters import DeviceAdapters
from xinserve.engines.lora.memory import lora_slot_bytes
from xinserve.engines.model_loader import load_model
from xinserve.kernels.ops import REFERENCE_OPS


@pytest.mark.parametrize(("arch", "dtype"), [("llama", torch.float32), ("qwen3_moe", torch.bfloat16)])
def test_slot_bytes_equal_the_allocated_stacks(tiny_models, arch, dtype):
    model, config = load_model(str(tiny_models(arch)), dtype, torch.device("cpu"))
    slots = DeviceAdapters(model, max_loras=3, max_rank=8, max_rows=16, ops=REFERENCE_OPS)
    allocated = sum(buffer.nbytes for _, s in slots.stacks for name, buffer in s.named_buffers()
                    if name != "step_slots")
    assert slots.slot_bytes() * 3 == allocated
    assert lora_slot_bytes(config, 8, dtype) == slots.slot_bytes()
    if arch == "qwen3_moe":
        # attention on every layer, the MLP on the dense one, the routed experts on the others
        moe_layers = model.num_layers - 1
        assert len(slots.stacks) == 2 * model.num_layers + 2 + moe_layers
        assert sum(prefix.endswith("experts.") for prefix, _ in slots.stacks) == moe_layers
