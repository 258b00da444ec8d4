"""This tree's C++ decode attention against another build of it (``--baseline-so``: the module file of a
build of another source, e.g. ``~/.cache/xinserve/torch_extensions/paged_decode_<key>/xinserve_paged_decode_<key>.so``),
in one process, arms alternating call by call so that a loaded machine weighs on both alike.

The workload is ``decode_attention_realistic.py``'s step (batch 32 x 512-token contexts, the 5M Llama's 4 layers,
2 KV heads of 64, blocks of 16, float32) over two pools: ``cold``, a 1 GiB pool on huge pages with scattered
block tables (the step reads 67 MB from DRAM, as a server's does), and ``hot``, every table pointing at the
same 4 blocks (the rows stay in L1/L2: the kernel's arithmetic alone, no memory wait). Per pool, thread count
and arm: the median and the least process CPU time per step (``time.process_time``, all threads) over
``--repeats``. Prints a markdown table and writes ``benchmarks/results/decode_attention_ab.json``.

    PYTHONPATH=. python benchmarks/decode_attention_ab.py --baseline-so PATH [--threads 1,2] [--repeats 15]
"""

import argparse
import importlib.machinery
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the server's CPU workers run (server/pool.py)

import numpy as np
import torch
from decode_attention_realistic import BATCH, BLOCK, CONTEXT, HEAD_DIM, HEADS, LAYERS, make_pool

RESULTS = Path(__file__).resolve().parent / "results" / "decode_attention_ab.json"


def load_module(path: str):
    """A built extension module from its file (its torch operators register under their own namespace)."""
    name = Path(path).name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-so", required=True)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from xinserve.kernels import cpp

    arms = {"baseline": load_module(args.baseline_so), "this tree": cpp._extension}
    cache = make_pool("auto", "thp", 1 << 30)
    num_blocks, per_seq = cache.shape[2], CONTEXT // BLOCK
    rng = np.random.default_rng(0)
    scattered = [torch.from_numpy(rng.permutation(num_blocks)[: BATCH * per_seq].reshape(BATCH, per_seq)
                                  .astype(np.int32)) for _ in range(LAYERS)]
    tables = {"cold": scattered, "hot": [t % 4 for t in scattered]}
    lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32)
    queries = [torch.randn(BATCH, HEADS, HEAD_DIM) for _ in range(LAYERS)]
    rows = []
    with torch.inference_mode():
        for pool, layer_tables in tables.items():
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                samples = {arm: [] for arm in arms}
                outputs = {}
                for _ in range(args.repeats + 1):
                    for arm, module in arms.items():
                        cpu = time.process_time()
                        for layer in range(LAYERS):
                            outputs[arm] = module.paged_decode_attention(queries[layer], cache[0, layer], cache[1, layer],
                                                                         layer_tables[layer], lens, 0.125)
                        samples[arm].append(time.process_time() - cpu)
                torch.testing.assert_close(outputs["this tree"], outputs["baseline"], atol=2e-5, rtol=2e-5)
                row = {"pool": pool, "threads": threads}
                for arm, values in samples.items():
                    row[f"{arm} median ms"] = 1e3 * statistics.median(values[1:])
                    row[f"{arm} min ms"] = 1e3 * min(values[1:])
                row["median ratio"] = row["baseline median ms"] / row["this tree median ms"]
                rows.append(row)
    result = {"batch": BATCH, "context": CONTEXT, "layers": LAYERS, "baseline": args.baseline_so,
              "load_average": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"load average {os.getloadavg()}")
    print("| pool | threads | baseline CPU ms/step (median / min) | this tree (median / min) | baseline / this tree |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['pool']} | {r['threads']} | {r['baseline median ms']:.2f} / {r['baseline min ms']:.2f} | "
              f"{r['this tree median ms']:.2f} / {r['this tree min ms']:.2f} | {r['median ratio']:.2f}x |")


if __name__ == "__main__":
    main()
