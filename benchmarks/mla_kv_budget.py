"""KV-cache cost of multi-head latent attention against dense grouped-query attention.

For each model (the real checkpoints' shapes, built on the meta device, so nothing is allocated) it
asks the model for its cache spec, as ModelRunner does when it sizes the pool: bytes per token, then
how many blocks a fixed memory budget holds and how many 4k-token sequences fit at once. Each MLA
model is paired with a dense GQA model of the same size (layers, hidden size, query heads) with 8
KV heads of 128, the common GQA shape (and, for scale, with one KV head per query head: plain MHA). Prints a table and writes benchmarks/results/mla_kv_budget.json.

    PYTHONPATH=. python benchmarks/mla_kv_budget.py [--budget-gib 64] [--block-size 128] [--seq-len 4096]
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import DeepseekV3Config, GlmMoeDsaConfig, LlamaConfig

from xinserve.engines.models import MODEL_REGISTRY

RESULTS = Path(__file__).resolve().parent / "results" / "mla_kv_budget.json"


def deepseek_v3() -> DeepseekV3Config:
    """DeepSeek-V3 / R1's shapes (config.json of deepseek-ai/DeepSeek-V3)."""
    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_group=8, topk_group=4,
        num_experts_per_tok=8, first_k_dense_replace=3, architectures=["DeepseekV3ForCausalLM"],
    )


def glm_5() -> GlmMoeDsaConfig:
    """GLM-5's shapes (transformers' GlmMoeDsaConfig defaults): MLA plus a 128-wide indexer key per layer."""
    return GlmMoeDsaConfig(architectures=["GlmMoeDsaForCausalLM"])


def dense(like: object, kv_heads: int | None = 8) -> LlamaConfig:
    """A dense model of the same size as ``like`` (its layers, hidden size and query heads) with
    ``kv_heads`` KV heads of 128 (None: one per query head, plain multi-head attention)."""
    return LlamaConfig(
        vocab_size=like.vocab_size, hidden_size=like.hidden_size, num_hidden_layers=like.num_hidden_layers,
        num_attention_heads=like.num_attention_heads, num_key_value_heads=kv_heads or like.num_attention_heads,
        head_dim=128,
        intermediate_size=like.intermediate_size, architectures=["LlamaForCausalLM"],
    )


def bytes_per_token(config: object, dtype: torch.dtype) -> int:
    """The model's own cache spec, from the model built on the meta device."""
    with torch.device("meta"):
        model = MODEL_REGISTRY[config.architectures[0]](config)
    return model.kv_bytes_per_token(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=64.0, help="memory given to KV blocks")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per block (Ascend's default)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    args = parser.parse_args()
    dtype = torch.bfloat16
    budget = int(args.budget_gib * 2**30)
    blocks_per_seq = -(-args.seq_len // args.block_size)
    rows = []
    for name, config in (("DeepSeek-V3 (MLA)", deepseek_v3()), ("GLM-5 (MLA + DSA indexer)", glm_5())):
        variants = ((name, config), ("  dense GQA, same size (8 KV heads x 128)", dense(config)),
                    ("  dense MHA, same size (a KV head per query head)", dense(config, None)))
        for label, cfg in variants:
            per_token = bytes_per_token(cfg, dtype)
            blocks = budget // (per_token * args.block_size)
            rows.append({"model": label.strip(), "layers": cfg.num_hidden_layers, "kv_bytes_per_token": per_token,
                         "blocks": blocks, "max_concurrent_seqs": blocks // blocks_per_seq})
    for i, row in enumerate(rows):
        mla = rows[i - i % 3]
        row["bytes_over_mla"] = round(row["kv_bytes_per_token"] / mla["kv_bytes_per_token"], 2)
    header = f"{'model':<50} {'layers':>6} {'KV B/token':>11} {'blocks':>8} {f'{args.seq_len}-tok seqs':>12}  x MLA's bytes"
    print(f"bf16, {args.budget_gib:g} GiB of KV blocks of {args.block_size} tokens")
    print(header)
    print("-" * len(header))
    for i, row in enumerate(rows):
        ratio = f"{row['bytes_over_mla']:.2f}x"
        label = row["model"] if i % 3 == 0 else "  " + row["model"]
        print(f"{label:<50} {row['layers']:>6} {row['kv_bytes_per_token']:>11,} {row['blocks']:>8,} "
              f"{row['max_concurrent_seqs']:>12,}  {ratio}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"dtype": "bfloat16", "budget_gib": args.budget_gib, "block_size": args.block_size,
                                   "seq_len": args.seq_len, "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
