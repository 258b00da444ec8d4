"""``xinserve plan`` for GLM-5 (transformers' default ``GlmMoeDsaConfig``: 744B parameters, 78 layers, MLA
+ DSA indexer, 256 experts) in bf16, W8A8 and W4A8 on 8 and 16 x 64 GiB cards and on 16 x 80 GiB:
weights and KV per device, how many sequences fit at the full 202,752-token context and at 32k, and
why not when it does not fit. Nothing is loaded (engines/capacity.py). Prints a table and writes
benchmarks/results/capacity_plan.json.

    PYTHONPATH=. python benchmarks/capacity_plan.py
"""

import json
import tempfile
from pathlib import Path

from transformers import GlmMoeDsaConfig

from xinserve.engines.capacity import GIB, Layout, plan

RESULTS = Path(__file__).resolve().parent / "results" / "capacity_plan.json"
FORMATS = {"bf16": "none", "W8A8": "w8a8", "W4A8": "w4a8"}
CARDS = [(8, 64, Layout(tp=8)), (16, 64, Layout(tp=16)), (16, 64, Layout(tp=8, pp=2)), (16, 80, Layout(tp=16))]
SHORT = 32768


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as path:
        GlmMoeDsaConfig(architectures=["GlmMoeDsaForCausalLM"], dtype="bfloat16").save_pretrained(path)
        for label, scheme in FORMATS.items():
            for devices, gib, layout in CARDS:
                full = plan(path, devices=devices, device_memory_gib=gib, layout=layout, quantization=scheme)
                short = plan(path, devices=devices, device_memory_gib=gib, layout=layout, quantization=scheme,
                             max_model_len=SHORT)
                rows.append({
                    "format": label, "devices": devices, "device_memory_gib": gib, "tp": layout.tp, "pp": layout.pp,
                    **full.as_json(), "max_sequences_at_32k": short.max_sequences,
                    "reason": None if full.reason is None else full.reason.partition(": ")[2],
                })
    print(f"GLM-5, {rows[0]['parameters'] / 1e9:.1f}B parameters; KV in bf16, block 128, 0.7 of the rest to KV")
    print(f"{'format':6} {'cards':>10} {'layout':>9} {'weights/dev':>12} {'KV B/tok/dev':>12} "
          f"{'seqs@202k':>9} {'seqs@32k':>8}  fits")
    for r in rows:
        print(f"{r['format']:6} {r['devices']:>3} x {r['device_memory_gib']:>2} GiB "
              f"{'TP' + str(r['tp']) + (' PP' + str(r['pp']) if r['pp'] > 1 else ''):>9} "
              f"{r['weight_bytes_per_device'] / GIB:>8.1f} GiB {r['kv_bytes_per_token_per_device']:>12,} "
              f"{r['max_sequences']:>9} {r['max_sequences_at_32k']:>8}  "
              f"{'yes' if r['fits'] else 'no: ' + r['reason']}")
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
