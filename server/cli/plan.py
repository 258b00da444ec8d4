"""``xinserve plan``: will a model fit a set of cards, and how many sequences at full length?

With ``--max-loras`` it counts that many LoRA adapter slots beside the weights (engines/lora/memory.py).
With ``--prompt-len`` (and ``--output-len``) it also sizes prefill/decode disaggregation
(docs/disaggregation.md) with the layout given, one side at a time: the KV bytes a decode instance reads
per request (the prompt's, every rank's), how many prompts a prefill instance holds at once (computing, or
held until read) and how many whole requests (prompt + output) a decode instance holds.

Reads only the model directory's config.json (engines/core/capacity.py does the arithmetic with the
model's own classes on the meta device). Exit status: 0 when it fits, 1 when it does not, 2 for a
bad argument or an unreadable model.
"""

import argparse
import json
import sys

from xinserve.engines.core.capacity import GIB, KV_CACHE_DTYPES, QUANTIZATION_SCHEMES, Layout, Plan, plan
from xinserve.engines.model_loader import parse_dtype
from xinserve.server.cli.bad_input import BadInput


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory (config.json is enough)")
    p.add_argument("--devices", type=int, help="cards in all (default: one replica, tp x pp)")
    p.add_argument("--device-memory", type=float, default=64.0, metavar="GIB", help="memory per card, GiB")
    p.add_argument("--tensor-parallel-size", type=int, help="ranks per stage (default: devices / pp)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1, help="stages, contiguous layer ranges")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="whole routed experts per rank (E / tp each) instead of a slice of every expert")
    p.add_argument("--quantization", choices=QUANTIZATION_SCHEMES, default="none",
                   help="linear weights' format; embeddings, LM head, norms and routers stay unquantized")
    p.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto",
                   help="auto: the model's dtype")
    p.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
                   help="unquantized weights and activations; auto: the checkpoint's dtype, as the engine loads it")
    p.add_argument("--max-model-len", type=int, help="tokens per sequence (default: max_position_embeddings)")
    p.add_argument("--block-size", type=int, default=128, help="tokens per KV block (128: Ascend's)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.7,
                   help="share of the memory left after the weights given to KV blocks (the accelerators' default)")
    p.add_argument("--mtp", action="store_true",
                   help="count the checkpoint's MTP layer too (speculative method mtp: its weights and KV layer)")
    p.add_argument("--max-loras", type=int, default=0, metavar="N",
                   help="LoRA adapter slots on each device (serve's --enable-lora --max-loras); 0: no LoRA")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the slots' rank (serve's --max-lora-rank)")
    p.add_argument("--prompt-len", type=int, metavar="TOKENS",
                   help="size prefill/decode disaggregation for prompts of this length (docs/disaggregation.md)")
    p.add_argument("--output-len", type=int, default=0, metavar="TOKENS",
                   help="with --prompt-len: the tokens each request generates on the decode side")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    pp = args.pipeline_parallel_size
    tp = args.tensor_parallel_size or max(1, (args.devices or pp) // pp)
    for flag, value in (("--devices", args.devices), ("--tensor-parallel-size", tp), ("--pipeline-parallel-size", pp),
                        ("--max-model-len", args.max_model_len), ("--block-size", args.block_size),
                        ("--max-lora-rank", args.max_lora_rank)):
        if value is not None and value < 1:
            raise BadInput(f"{flag} must be at least 1, got {value}")
    if args.max_loras < 0:
        raise BadInput(f"--max-loras must be at least 0, got {args.max_loras}")
    if args.prompt_len is not None and args.prompt_len < 1 or args.output_len < 0:
        raise BadInput("--prompt-len must be at least 1 and --output-len at least 0")
    if args.prompt_len is None and args.output_len:
        raise BadInput("--output-len needs --prompt-len")
    if args.device_memory <= 0 or not 0 < args.kv_cache_memory_fraction <= 1:
        raise BadInput("--device-memory must be positive and --kv-cache-memory-fraction in (0, 1]")
    try:
        result = plan(args.model, devices=args.devices, device_memory_gib=args.device_memory,
                      layout=Layout(tp, pp, args.enable_expert_parallel), quantization=args.quantization,
                      kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
                      dtype=parse_dtype(args.dtype), block_size=args.block_size,
                      kv_cache_memory_fraction=args.kv_cache_memory_fraction, mtp=args.mtp,
                      max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    except (OSError, ValueError) as exc:  # an unreadable model directory or config.json (read_config)
        raise BadInput(str(exc)) from None
    sides = disaggregation(result, args.prompt_len, args.output_len) if args.prompt_len else None
    if args.json:
        print(json.dumps({**result.as_json(), **({"disaggregation": sides} if sides else {})}, indent=2))
    else:
        print(table(result) + ("\n" + disaggregation_table(sides) if sides else ""))
    if sides and result.fits and args.prompt_len + args.output_len > result.max_model_len:
        print(f"xinserve plan: --prompt-len + --output-len is more than max model len {result.max_model_len}",
              file=sys.stderr)
        return 1
    return 0 if result.fits else 1


def disaggregation(result: Plan, prompt_len: int, output_len: int) -> dict[str, int]:
    """One request's transfer and what each side holds at once, with ``result``'s layout and cards."""
    per_device = prompt_len * result.kv_bytes_per_token_per_device
    return {"prompt_len": prompt_len, "output_len": output_len,
            "kv_bytes_per_request": prompt_len * result.kv_bytes_per_token_per_replica,
            "kv_bytes_per_request_per_device": per_device,
            "prefill_requests_held": result.sequences_of(prompt_len),
            "decode_requests_held": result.sequences_of(prompt_len + output_len)}


def disaggregation_table(sides: dict[str, int]) -> str:
    prompt, output = sides["prompt_len"], sides["output_len"]
    rows = [
        ("P/D transfer per request", (f"{sides['kv_bytes_per_request'] / (1 << 20):,.1f} MiB "
                                      f"({sides['kv_bytes_per_request_per_device']:,} B per device)")),
        ("prefill side holds", f"{sides['prefill_requests_held']:,} prompts of {prompt:,} tokens"),
        ("decode side holds", f"{sides['decode_requests_held']:,} requests of {prompt:,} + {output:,} tokens"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def table(result: Plan) -> str:
    """The plan as aligned ``name  value`` lines."""
    layout, lora = result.layout, result.lora_bytes_per_device
    experts = "whole experts per rank" if layout.ep else "a slice of every expert per rank"
    rows = [
        ("model", result.model),
        ("parameters", f"{result.parameters / 1e9:.1f} B ({result.parameters:,})"),
        ("layout", f"{result.replicas} replica(s) of TP {layout.tp} x PP {layout.pp} ({experts})"),
        ("device memory", f"{result.device_memory_bytes / GIB:g} GiB"),
        ("quantization", f"{result.quantization}, KV cache {result.kv_cache_dtype}"),
        ("weights per device", f"{result.weight_bytes_per_device / GIB:.2f} GiB ({result.weight_bytes_per_device:,} B)"),
        *([("LoRA slots per device", f"{lora / (1 << 20):,.1f} MiB ({lora:,} B)")] if lora else []),
        ("KV per token per device", f"{result.kv_bytes_per_token_per_device:,} B"),
        ("max model len", f"{result.max_model_len:,}"),
        ("max sequences", f"{result.max_sequences:,}"),
        ("fits", "yes" if result.fits else f"no: {result.reason}"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
