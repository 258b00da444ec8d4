"""CPU microseconds of ``DecodeBuffers.fill`` (engines/decode_buckets.py): copying one pure-decode
step's inputs into a compiled bucket's static buffers, at batch 1, 8 and 30 (bucket 32), for buckets up
to 32 over a 2048-token context in blocks of 16. Thread CPU time (the machine is shared), the cheapest
of 7 rounds of 2,000 fills. Run it on two trees to compare them: ``PYTHONPATH=TREE python
benchmarks/bucket_fill.py --out benchmarks/results/bucket_fill_NAME.json``.
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from xinserve.engines.decode_buckets import DecodeBuffers
from xinserve.kernels.attention_metadata import AttentionMetadata, build_decode_gather

RESULTS = Path(__file__).resolve().parent / "results" / "bucket_fill.json"
POINTS = ((1, 1), (8, 8), (30, 32))  # (rows, bucket)


def fill_us(buffers: DecodeBuffers, rows: int, bucket: int, rounds: int = 7, calls: int = 2000) -> float:
    tables = np.arange(rows * 5, dtype=np.int32).reshape(rows, 5)  # [rows, 5] int32
    lens = np.arange(rows, dtype=np.int32) + 60  # [rows] contexts of 60 .. 60 + rows - 1
    metadata = AttentionMetadata(torch.from_numpy(np.arange(rows, dtype=np.int64)), torch.from_numpy(tables),
                                 torch.from_numpy(lens), rows, [0], [],
                                 build_decode_gather(tables, lens, 16, torch.device("cpu")))
    ids, positions = torch.arange(rows) + 3, torch.arange(rows) + 59
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            buffers.fill(bucket, ids, positions, metadata)
        best = min(best, (time.thread_time() - start) / calls)
    return 1e6 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    buffers = DecodeBuffers([1, 2, 4, 8, 16, 32], 2048, 16, 100, torch.device("cpu"))
    with torch.inference_mode():
        rows = [{"rows": r, "bucket": b, "fill_cpu_us": fill_us(buffers, r, b)} for r, b in POINTS]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"load_average": os.getloadavg(), "rows": rows}, indent=2) + "\n")
    print("| rows | bucket | fill CPU us |\n|---:|---:|---:|")
    for r in rows:
        print(f"| {r['rows']} | {r['bucket']} | {r['fill_cpu_us']:.1f} |")


if __name__ == "__main__":
    main()
