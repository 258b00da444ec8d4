"""Decode step time and memory of a ~33M-parameter Llama on CPU: float32 against W8A8 (int8 weights per
output channel, per-token int8 activations, quantized on the fly with ``quantization="w8a8"``) and
W4A16 (a compressed-tensors pack-quantized checkpoint, int4 groups of 128 with zero points, written
with the library's own compressor), each W8A8 / W4A16 run with every ``quant_linear`` candidate that
takes it forced (reference: weights stay quantized and are dequantized per call; dequant: dequantized
once at load, the memory trade; int8mm: ``torch._int_mm``).

Each variant runs in its own process, so its peak resident memory (``ru_maxrss``) is its own: load,
warm-up and the decode windows. Step time: ``engine.step()`` in steady decode after 64-token prompts,
the best of several windows of 10 steps (benchmarks/engine_timing.py). One thread. Prints a markdown
table and writes ``benchmarks/results/quantized_decode.json``.

    python benchmarks/quantized_decode.py [--windows 3]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from engine_timing import best_window, decoding

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "quantized_decode.json"
# 8 layers of hidden 512 (8 heads of 64, 4 KV heads), intermediate 1536, vocabulary 8000: 33M parameters
MODEL = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536,
         "vocab_size": 8000}
# name -> (checkpoint, quantization option, forced quant_linear kernel)
VARIANTS = {
    "float32": ("float", None, None),
    "w8a8 reference": ("float", "w8a8", "reference"),
    "w8a8 int8mm": ("float", "w8a8", "int8mm"),
    "w8a8 dequant": ("float", "w8a8", "dequant"),
    "w4a16 reference": ("w4a16", None, "reference"),
    "w4a16 dequant": ("w4a16", None, "dequant"),
}
BATCHES = (1, 8)
PROMPT_LEN, WINDOW = 64, 10


def build(model_dir: Path) -> dict[str, Path]:
    """The float checkpoint and its W4A16 copy (built once)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file, save_file

    from xinserve.server.embedded_model.factory import make_tiny_model

    float_dir, w4_dir = model_dir / "float", model_dir / "w4a16"
    if not (float_dir / "config.json").exists():
        make_tiny_model(float_dir, "llama", **MODEL)
    if not (w4_dir / "config.json").exists():
        args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=128)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        compressor = BaseCompressor.load_from_registry("pack-quantized")
        stored = {}
        for name, weight in load_file(float_dir / "model.safetensors").items():
            if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
                stored[name] = weight
                continue
            grouped = weight.view(weight.shape[0], -1, 128)
            scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
            module = name.removesuffix(".weight")
            packed = compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero}, scheme)
            stored.update({f"{module}.{leaf}": value for leaf, value in packed.items()})
        w4_dir.mkdir(parents=True, exist_ok=True)
        for item in float_dir.iterdir():
            if item.name != "model.safetensors":
                (w4_dir / item.name).write_bytes(item.read_bytes())
        config = json.loads((float_dir / "config.json").read_text())
        config["quantization_config"] = QuantizationConfig(
            config_groups={"group_0": scheme}, format="pack-quantized", quantization_status="compressed",
            ignore=["lm_head"]).model_dump(mode="json", exclude_none=True)
        (w4_dir / "config.json").write_text(json.dumps(config))
        save_file(stored, w4_dir / "model.safetensors", metadata={"format": "pt"})
    return {"float": float_dir, "w4a16": w4_dir}


def run_variant(name: str, path: Path, windows: int) -> dict:
    """In this process: load the variant, time its decode steps, report its memory."""
    import torch

    from xinserve.engines import LLM
    from xinserve.engines.quantization.install import weights_report

    torch.set_num_threads(1)
    _, quantization, kernel = VARIANTS[name]
    kernels = {"quant_linear": kernel} if kernel else None
    blocks = max(BATCHES) * -(-(PROMPT_LEN + 8 + windows * WINDOW + 8) // 16) + 16
    with LLM(str(path), dtype="float32", num_kv_blocks=blocks, max_num_seqs=max(BATCHES), block_size=16,
             quantization=quantization, kernels=kernels) as llm:
        engine = llm.engine
        report = weights_report(engine.runner.model)
        steps = {}
        for batch in BATCHES:
            with decoding(engine, batch, PROMPT_LEN, windows * WINDOW + 4):
                steps[batch] = round(best_window(engine, windows, WINDOW) * 1000, 3)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": name, "step_ms": steps, "weight_mib": round(report["bytes"] / 2**20, 2),
            "quantized_mib": round(report["quantized_bytes"] / 2**20, 2), "peak_rss_mib": round(peak_mib, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "xinserve-quant-bench")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in a child process
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    paths = build(args.model_dir)
    if args.variant:
        print(json.dumps(run_variant(args.variant, paths[VARIANTS[args.variant][0]], args.windows)))
        return
    rows = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XINSERVE_COMPILE": "off"}
    for name in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--variant", name, "--windows", str(args.windows),
                              "--model-dir", str(args.model_dir)], env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        write(args.out, rows)  # after each variant: a long run that is cut short keeps what it measured
    print("| variant | " + " | ".join(f"step ms b{b}" for b in BATCHES) + " | weights MiB | quantized MiB | peak RSS MiB |")
    print("|---|" + "---|" * (len(BATCHES) + 3))
    for row in rows:
        steps = " | ".join(str(row["step_ms"][str(b)]) for b in BATCHES)
        print(f"| {row['variant']} | {steps} | {row['weight_mib']} | {row['quantized_mib']} | {row['peak_rss_mib']} |")


def write(out: Path, rows: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": MODEL, "prompt_len": PROMPT_LEN, "window_steps": WINDOW, "threads": 1,
                               "compile": "off", "results": rows}, indent=1))


if __name__ == "__main__":
    main()
