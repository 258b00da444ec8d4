"""A compiled decode bucket called without dynamo (engines/worker/direct_call.py): the tensors dynamo traced
with are rebound to the step buffers (a view matched by address, shape, strides and dtype); a part of a
buffer that is no whole bucket view is refused; a graph whose kernels were swapped stops answering, so
the caller goes back through dynamo. No compile here: the "graph" returns the tensors it is called on."""

import dataclasses

import torch

from xinserve.engines.worker.decode_buckets import DecodeBuffers
from xinserve.engines.worker.direct_call import bucket_tensors, direct_call
from xinserve.kernels.ops import REFERENCE_OPS


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))
        self.ops = REFERENCE_OPS


def buffers() -> DecodeBuffers:
    return DecodeBuffers([1, 2], 16, 4, 0, torch.device("cpu"))


def echo(*flat: torch.Tensor) -> list[torch.Tensor]:
    return list(flat)


def test_the_traced_tensors_are_rebound_to_the_step_buffers_and_the_rest_kept():
    compiler, steps, layer = buffers(), buffers(), Layer()
    traced = [layer.weight, *bucket_tensors(*compiler.inputs(2))]  # the order dynamo chose
    call = direct_call(echo, traced, compiler.inputs(2), steps.inputs(2), layer)
    got = call()
    want = [layer.weight, *bucket_tensors(*steps.inputs(2))]
    assert [t.data_ptr() for t in got] == [t.data_ptr() for t in want]
    assert [t.shape for t in got] == [t.shape for t in want]
    steps.input_ids[:2] = torch.tensor([5, 6])  # a step's fill is what the bound graph reads
    assert call()[1].tolist() == [5, 6]


def test_a_part_of_a_buffer_that_is_no_bucket_view_is_refused():
    compiler, steps = buffers(), buffers()
    traced = [compiler.input_ids[1:2], *bucket_tensors(*compiler.inputs(2))[1:]]
    assert direct_call(echo, traced, compiler.inputs(2), steps.inputs(2), Layer()) is None


def test_a_graph_whose_kernels_were_swapped_stops_answering():
    compiler, steps, layer = buffers(), buffers(), Layer()
    call = direct_call(echo, bucket_tensors(*compiler.inputs(1)), compiler.inputs(1), steps.inputs(1), layer)
    assert call() is not None
    layer.ops = dataclasses.replace(REFERENCE_OPS)  # what engines/worker/warmup.py's swap_ops does
    assert call() is None


def test_step_buffers_of_another_shape_or_dtype_are_refused():
    compiler, layer = buffers(), Layer()
    traced = bucket_tensors(*compiler.inputs(2))
    wider = DecodeBuffers([1, 2], 32, 4, 0, torch.device("cpu"))  # block tables [2, 8], not [2, 4]
    assert direct_call(echo, traced, compiler.inputs(2), wider.inputs(2), layer) is None
    other = buffers()
    other.input_ids = other.input_ids.to(torch.int32)
    assert direct_call(echo, traced, compiler.inputs(2), other.inputs(2), layer) is None
