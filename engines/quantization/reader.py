"""Which reader a checkpoint goes through: its own format's (detected, engines/quantization/formats/),
on-the-fly quantization of a float checkpoint (``--quantization fp8`` / ``w8a8``), or none.

``--quantization`` (``EngineConfig.quantization``, vLLM's flag and names) forces a scheme: a quantized
checkpoint in another format is refused, as is a float checkpoint for a format that only a
quantized checkpoint can have (gptq, compressed-tensors, ...). Unset: the checkpoint says.
"""

from collections.abc import Callable, Iterator
from typing import Any

import torch

from xinserve.engines.quantization import online
from xinserve.engines.quantization.formats import FORMATS, detect_format
from xinserve.kernels.quantized_weight import QuantizedWeight

Stream = Iterator[tuple[str, torch.Tensor]]
Reader = Callable[[Stream], Iterator[tuple[str, torch.Tensor | QuantizedWeight]]]


def checkpoint_reader(path: str, config: Any, requested: str | None, kept_float: tuple[str, ...] = ()
                      ) -> tuple[str, Reader] | None:
    """(the scheme's name, the reader) for the checkpoint at ``path``; None: a float checkpoint read
    as it is. ``kept_float``: weight-name suffixes on-the-fly quantization leaves alone (the model's
    ``FLOAT_WEIGHTS``). Raises ValueError for an unimplemented or mismatched scheme."""
    detected = detect_format(path, config)
    if detected is not None:
        if requested is not None and requested != detected:
            raise ValueError(f"quantization {requested!r} was asked for, but the checkpoint at {path!r} is "
                             f"quantized as {detected!r}")
        module = FORMATS[detected]
        return detected, lambda tensors: module.read(path, config, tensors)
    if requested is None:
        return None
    if requested in online.SCHEMES:
        return requested, lambda tensors: online.quantize_stream(tensors, requested, kept_float)
    raise ValueError(f"quantization {requested!r} needs a checkpoint quantized as {requested!r}, and the one at "
                     f"{path!r} holds float weights (a float checkpoint is quantized on the fly with "
                     f"{' or '.join(online.SCHEMES)})")
