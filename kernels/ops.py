"""The ops a model calls, grouped as the kernel registry chooses them, and the table of chosen
functions a model is built with.

An op is one or more functions that are chosen together: rotary is ``rotary_cos_sin`` (the step's
table, built once for all layers) plus ``rotary_embedding`` (applied per layer), because a vendor
kernel wants its own table layout; fused_moe is ``select_experts`` (routing) plus ``fused_moe`` (the
experts), because a vendor's routing output is laid out for its own expert kernels. Every
implementation module (``xinserve.kernels.references.dense``, ``xinserve.kernels.triton``, ``xinserve.kernels.ascend.ops``, ...) exposes
``OPS``: function name -> function, for the functions it implements, with the reference signatures.

A function says what graph capture (engines/worker/graphs.py) must know of it as attributes, like cpp's
``build_key``: ``graph_capturable = False`` when a captured replay would be wrong (it reads host
values that a graph freezes), ``graph_capture_hook`` a context-manager factory to wrap each capture
in, yielding what to call before each replay (Ascend's paged attention re-issues its task groups).
"""

from collections.abc import Callable
from dataclasses import dataclass, fields

from xinserve.kernels.references import dense as reference

# op -> the functions that make it up, in ``KernelOps`` field names
OP_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "write_kv": ("write_kv",),
    "prefill_attention": ("paged_prefill_attention",),
    "decode_attention": ("paged_decode_attention",),
    "rms_norm": ("rms_norm",),
    "rotary": ("rotary_cos_sin", "rotary_embedding"),
    "silu_and_mul": ("silu_and_mul",),
    "fused_moe": ("select_experts", "fused_moe"),
    "top_k_top_p": ("top_k_top_p",),
    # the dense linear layers (F.linear's contract): projections, MLP, lm_head
    "linear": ("linear",),
    # multi-head latent attention and DSA (kernels/references/mla.py); only MLA models call them
    "write_latent": ("write_latent",),
    "mla_decode_attention": ("mla_decode_attention",),
    "mla_prefill_attention": ("mla_prefill_attention",),
    "indexer_topk": ("indexer_topk",),
    # quantized checkpoints (kernels/references/quant.py); only models with quantized weights call them
    "quant_linear": ("prepare_quant_weight", "quant_linear"),
    "quant_fused_moe": ("prepare_quant_experts", "quant_fused_moe"),
    # multi-LoRA (kernels/references/lora.py); only a model served with adapters (--enable-lora) calls them
    "lora": ("lora_shrink", "lora_expand"),
}
OPS = tuple(OP_FUNCTIONS)


@dataclass(frozen=True, slots=True)
class KernelOps:
    """The functions a model and the sampler call, one per field, bound once at build time (the
    step's hot path looks nothing up). Signatures: those of ``xinserve.kernels.references.dense``."""

    write_kv: Callable
    paged_prefill_attention: Callable
    paged_decode_attention: Callable
    rms_norm: Callable
    rotary_cos_sin: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    select_experts: Callable
    fused_moe: Callable
    top_k_top_p: Callable
    linear: Callable
    write_latent: Callable
    mla_decode_attention: Callable
    mla_prefill_attention: Callable
    indexer_topk: Callable
    prepare_quant_weight: Callable
    quant_linear: Callable
    prepare_quant_experts: Callable
    quant_fused_moe: Callable
    lora_shrink: Callable
    lora_expand: Callable

    @classmethod
    def from_functions(cls, functions: dict[str, Callable]) -> "KernelOps":
        return cls(**{f.name: functions[f.name] for f in fields(cls)})


REFERENCE_OPS = KernelOps.from_functions(reference.OPS)
