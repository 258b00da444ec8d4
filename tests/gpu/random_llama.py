"""Random-weight Llama checkpoints of real layer shapes for the device script (tests/gpu/bench_cuda.py),
written fast: each tensor drawn on the device in the model's dtype, saved in shards of ~2 GB, the
tokenizer the tiny models use (its ids are a prefix of the vocabulary). The weights are scaled small
(std 0.02, norms 1) so activations stay finite; greedy outputs are noise, step times are real.

``matmul_floor_ms``: the floor a decode step is compared with, one graph of the model's matmuls alone
(qkv, o, gate_up, down per layer) at a batch, timed on the device."""

import statistics
import time
from pathlib import Path

import torch

# make_tiny_model-style shapes of the models issue 42 measured (plus the CPU smoke run's)
SHAPES = {
    "llama-3.2-1b": {"hidden_size": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8,
                     "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True},
    "llama-3-8b": {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
                   "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False},
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
             "vocab_size": 2048, "tie_word_embeddings": True},
}
SHARD_BYTES = 2 << 30


def write_checkpoint(path: Path, shape: dict, dtype: torch.dtype, device: torch.device,
                     max_position_embeddings: int = 4096) -> Path:
    """A Llama of ``shape`` with random weights at ``path`` (reused when its config is already there)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from xinserve.server.embedded_model.tokenizer import make_tokenizer

    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    make_tokenizer(path, model_max_length=max_position_embeddings)
    config = LlamaConfig(hidden_size=shape["hidden_size"], num_hidden_layers=shape["num_layers"],
                         num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                         intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"],
                         tie_word_embeddings=shape["tie_word_embeddings"], rope_theta=500000.0,
                         max_position_embeddings=max_position_embeddings, bos_token_id=1, eos_token_id=2,
                         torch_dtype=str(dtype).removeprefix("torch."), architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        names = {name: tuple(p.shape) for name, p in LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    shard, size, index = {}, 0, 0
    generator = torch.Generator(device).manual_seed(0)
    for name, dims in names.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(dims, dtype=dtype, device=device)
        else:
            tensor = (torch.randn(dims, generator=generator, device=device, dtype=torch.float32) * 0.02).to(dtype)
        shard[name] = tensor.cpu()
        size += tensor.numel() * tensor.element_size()
        if size >= SHARD_BYTES:
            save_file(shard, str(path / f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
            shard, size, index = {}, 0, index + 1
    if shard:
        save_file(shard, str(path / f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)  # last: its presence says the checkpoint is whole
    return path


def layer_matmuls(shape: dict, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (qkv [hidden, (H + 2 KVH) D], o [H D, hidden], gate_up [hidden, 2 I], down [I, hidden]),
    uninitialised: a matmul's time does not depend on the values."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_heads"]
    qkv = (shape["num_heads"] + 2 * shape["num_kv_heads"]) * head_dim
    return [tuple(torch.empty(*dims, dtype=dtype, device=device) for dims in
                  ((hidden, qkv), (shape["num_heads"] * head_dim, hidden), (hidden, 2 * inter), (inter, hidden)))
            for _ in range(shape["num_layers"])]


def matmul_floor_ms(weights: list[tuple[torch.Tensor, ...]], batch: int, device: torch.device,
                    iters: int = 20) -> float:
    """Median ms of every layer's four matmuls at ``batch`` rows: one captured graph replayed on a GPU,
    plain calls timed with a wall clock elsewhere (the CPU smoke run)."""
    qkv, o, _, down = weights[0]
    dtype = qkv.dtype
    x = torch.zeros(batch, qkv.shape[0], dtype=dtype, device=device)
    attn = torch.zeros(batch, o.shape[0], dtype=dtype, device=device)
    act = torch.zeros(batch, down.shape[0], dtype=dtype, device=device)

    def run() -> None:
        for w_qkv, w_o, w_gate_up, w_down in weights:
            torch.mm(x, w_qkv)
            torch.mm(attn, w_o)
            torch.mm(x, w_gate_up)
            torch.mm(act, w_down)

    if device.type != "cuda":
        run()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # cuBLAS's handles and workspaces, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)

