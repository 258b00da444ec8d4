"""``xinserve plan``: the table, ``--json`` with its keys, exit 1 with the reason when the model
does not fit, 2 for a bad argument; a directory holding only config.json is enough."""

import json
import shutil

import torch

from xinserve.server.cli.main import main

KEYS = {"parameters", "weight_bytes_per_device", "lora_bytes_per_device", "kv_bytes_per_token_per_device", "max_sequences",
        "fits", "reason"}


def config_only(tiny_models, tmp_path, arch: str) -> str:
    shutil.copy(tiny_models(arch) / "config.json", tmp_path / "config.json")
    return str(tmp_path)


def test_json_plan_of_a_config_alone(tiny_models, tmp_path, capsys):
    path = config_only(tiny_models, tmp_path, "glm_moe_dsa")
    assert main(["plan", "--model", path, "--devices", "4", "--tensor-parallel-size", "2",
                 "--pipeline-parallel-size", "2", "--enable-expert-parallel", "--quantization", "w8a8",
                 "--kv-cache-dtype", "bfloat16", "--max-model-len", "1024", "--device-memory", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan) == KEYS
    assert plan["fits"] is True and plan["reason"] is None and plan["max_sequences"] > 0
    # bf16 KV: two bytes per latent and indexer-key value of the stage's 1 or 2 of 3 layers (MLA's latent
    # cache takes no 8-bit kind yet, and the planner refuses one as the engine does)
    assert plan["kv_bytes_per_token_per_device"] == -(-(3 * (32 + 8) + 3 * 16) * 2 * 2 // 3)


def test_a_plan_that_does_not_fit_exits_1_with_the_reason(tiny_models, tmp_path, capsys):
    path = config_only(tiny_models, tmp_path, "llama")
    assert main(["plan", "--model", path, "--device-memory", "0.0001"]) == 1
    out = capsys.readouterr().out
    assert "parameters" in out and "KV per token per device" in out
    assert "no: model LlamaForCausalLM at" in out and "the weights need" in out


def test_bad_arguments_exit_2(tiny_models, tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path / "missing")]) == 2
    assert "xinserve plan:" in capsys.readouterr().err
    path = config_only(tiny_models, tmp_path, "llama")
    assert main(["plan", "--model", path, "--devices", "0"]) == 2
    assert "--devices must be at least 1" in capsys.readouterr().err


def plan_json(capsys, path: str, *argv: str) -> dict:
    main(["plan", "--model", path, "--devices", "4", "--tensor-parallel-size", "2", "--device-memory", "0.05",
          "--block-size", "16", "--json", *argv])
    return json.loads(capsys.readouterr().out)


def test_disaggregation_sizes_the_transfer_and_each_sides_requests(tiny_models, tmp_path, capsys):
    path = config_only(tiny_models, tmp_path, "llama")
    whole = plan_json(capsys, path, "--max-model-len", "512")
    assert "disaggregation" not in whole  # only with --prompt-len
    sides = plan_json(capsys, path, "--max-model-len", "512", "--prompt-len", "300", "--output-len", "100")[
        "disaggregation"]
    # The prompt's KV on every rank of the replica (its KV heads split over TP 2): what a decode instance reads.
    per_device = 300 * whole["kv_bytes_per_token_per_device"]
    assert sides["kv_bytes_per_request_per_device"] == per_device and sides["kv_bytes_per_request"] == 2 * per_device
    # A prefill side holds as many prompts as a plan at max-model-len = the prompt says; a decode side as many
    # whole requests as one at prompt + output (the same pools, another sequence length).
    assert sides["prefill_requests_held"] == plan_json(capsys, path, "--max-model-len", "300")["max_sequences"]
    assert sides["decode_requests_held"] == plan_json(capsys, path, "--max-model-len", "400")["max_sequences"]
    assert sides["prefill_requests_held"] > sides["decode_requests_held"] > 0


def test_disaggregation_table_and_its_bad_arguments(tiny_models, tmp_path, capsys):
    path = config_only(tiny_models, tmp_path, "llama")
    assert main(["plan", "--model", path, "--prompt-len", "1000", "--output-len", "24", "--max-model-len", "2048"]) == 0
    out = capsys.readouterr().out
    assert "P/D transfer per request" in out and "prompts of 1,000 tokens" in out
    assert "requests of 1,000 + 24 tokens" in out
    assert main(["plan", "--model", path, "--prompt-len", "2000", "--output-len", "100", "--max-model-len", "2048"]) == 1
    assert "more than max model len 2048" in capsys.readouterr().err
    for argv, message in ((["--prompt-len", "0"], "--prompt-len must be at least 1"),
                          (["--output-len", "5"], "--output-len needs --prompt-len")):
        assert main(["plan", "--model", path, *argv]) == 2
        assert message in capsys.readouterr().err


def test_lora_slots_are_counted_beside_the_weights(tiny_models, tmp_path, capsys):
    from transformers import AutoConfig

    from xinserve.engines.lora.memory import lora_slot_bytes

    path = config_only(tiny_models, tmp_path, "llama")
    base = plan_json(capsys, path, "--max-model-len", "512")
    lora = plan_json(capsys, path, "--max-model-len", "512", "--max-loras", "4", "--max-lora-rank", "32")
    slot = lora_slot_bytes(AutoConfig.from_pretrained(path), 32, torch.float32, tensor_parallel_size=2)
    assert base["lora_bytes_per_device"] == 0 and lora["lora_bytes_per_device"] == 4 * slot > 0
    assert lora["weight_bytes_per_device"] == base["weight_bytes_per_device"]
    assert lora["max_sequences"] < base["max_sequences"]  # the KV pool is what is left after both
    main(["plan", "--model", path, "--max-loras", "2"])
    assert "LoRA slots per device" in capsys.readouterr().out
    assert main(["plan", "--model", path, "--max-loras", "-1"]) == 2
    assert "--max-loras must be at least 0" in capsys.readouterr().err
