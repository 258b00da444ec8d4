"""The MTP layer's draft logits equal a plain-torch reference of the MTP block built from the checkpoint's
tensors (transformers has no MTP): enorm / hnorm / eh_proj / the embedding zeroed at position 0 / the
shared head in plain torch; the decoder layer inside it is transformers' own layer of that architecture,
loaded with ``model.layers.<N>.*`` (a one-layer transformers model whose final norm is
``shared_head.norm`` and whose head is the shared one)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from xinserve.engines import LLM, SamplingParams
from xinserve.server.embedded_model.factory import ARCHS_BY_CONFIG

K = 2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def stacked_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert ``mlp.experts.<e>.<proj>.weight`` as transformers' stacked
    ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``down_proj`` [E, H, I]."""
    out = {key: value for key, value in tensors.items() if ".experts." not in key}
    count = len({key.split(".")[2] for key in tensors if key.startswith("mlp.experts.")})
    if count:
        out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([tensors[f"mlp.experts.{e}.gate_proj.weight"],
                                                                  tensors[f"mlp.experts.{e}.up_proj.weight"]])
                                                       for e in range(count)])
        out["mlp.experts.down_proj"] = torch.stack([tensors[f"mlp.experts.{e}.down_proj.weight"] for e in range(count)])
    return out


class MTPReference:
    """The checkpoint's MTP layer in plain torch around transformers' decoder layer."""

    def __init__(self, path) -> None:
        self.target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        config = AutoConfig.from_pretrained(path)
        self.eps, n = config.rms_norm_eps, config.num_hidden_layers
        tensors = load_file(f"{path}/model.safetensors")
        prefix = f"model.layers.{n}."
        self.mtp = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}
        self.embed = self.mtp.get("embed_tokens.weight", tensors["model.embed_tokens.weight"])
        head = self.mtp.get("shared_head.head.weight", tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]))
        # one MoE layer (the MTP layer is MoE in these configs: index N >= first_k_dense_replace)
        values = {key: None if key.endswith("layer_types") or key == "indexer_types" else value
                  for key, value in config.to_dict().items()}
        one = type(config)(**{**values, "num_hidden_layers": 1, "first_k_dense_replace": 0})
        self.block = ARCHS_BY_CONFIG[type(config)](one).eval()
        state = {f"model.layers.0.{key}": value for key, value in stacked_experts(self.mtp).items()
                 if key.split(".")[0] not in ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")}
        state.update({"model.norm.weight": self.mtp["shared_head.norm.weight"], "lm_head.weight": head,
                      "model.embed_tokens.weight": self.embed})
        missing, unexpected = self.block.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in key or "e_score_correction_bias" in key for key in missing), missing
        self.block.model.layers[0].mlp.gate.e_score_correction_bias.copy_(
            self.mtp["mlp.gate.e_score_correction_bias"])

    def inputs(self, next_tokens: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """eh_proj([enorm(embed(next)), hnorm(previous)]), the embedding zeroed at position 0."""
        embed = self.embed[next_tokens] * (positions != 0).unsqueeze(1)
        both = torch.cat([rms_norm(embed, self.mtp["enorm.weight"], self.eps),
                          rms_norm(previous, self.mtp["hnorm.weight"], self.eps)], dim=-1)
        return both @ self.mtp["eh_proj.weight"].T

    def run(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [L, hidden] at positions 0..L-1 -> (the layer's output g [L, hidden], logits [L, V])."""
        kept = []
        hook = self.block.model.layers[0].register_forward_hook(
            lambda module, args, out: kept.append(out[0] if isinstance(out, tuple) else out))
        logits = self.block(inputs_embeds=x[None], position_ids=torch.arange(x.shape[0])[None]).logits[0]
        hook.remove()
        return kept[0].reshape(x.shape), logits


@pytest.mark.parametrize(("arch", "own_head"), [("deepseek_v3", True), ("glm4_moe", False), ("glm_moe_dsa", False)])
def test_mtp_draft_logits_equal_the_plain_torch_reference(tiny_models, arch, own_head):
    path = tiny_models(arch, mtp=True, mtp_own_head=own_head)
    check_draft_logits(path, path, atol=2e-4)


@torch.inference_mode()
def check_draft_logits(path, reference_path, atol: float) -> None:
    """The engine's MTP logits at ``path`` (the prefill's catch-up, then the next step's chain) equal the
    plain-torch reference built from ``reference_path`` (the same weights in floats) within ``atol``."""
    llm = LLM(path, num_kv_blocks=32, block_size=4, speculative_config={"method": "mtp", "num_speculative_tokens": K})
    runner = llm.engine.runner
    calls = []  # (input ids [T], positions [T], the MTP layer's output [T, hidden]) of each MTP run
    run_mtp = runner._mtp

    def spy(input_ids, positions, previous, metadata):
        out = run_mtp(input_ids, positions, previous, metadata)
        calls.append((input_ids.clone(), positions.clone(), out.clone()))
        return out

    runner._mtp = spy
    prompt = [7, 300, 41, 9, 122, 5, 77, 18, 260, 33, 12]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1 + K + 1, ignore_eos=True))[0]
    model = runner.model
    head = model.lm_head.weight if model.lm_head is not None else model.model.embed_tokens.weight

    ref = MTPReference(reference_path)
    length = len(prompt)
    tokens = torch.tensor(prompt + out.token_ids[:1])
    target_hidden = ref.target.model(tokens[None, :length]).last_hidden_state[0]  # [L, hidden], after the norm
    positions = torch.arange(length)
    x = ref.inputs(tokens[1:], positions, target_hidden)
    g, logits = ref.run(x)
    # the prefill's catch-up: row p reads the target at p and the token at p + 1
    ids, got_positions, got = calls[0]
    assert ids.tolist() == tokens[1:].tolist() and got_positions.tolist() == positions.tolist()
    torch.testing.assert_close(model.mtp.compute_logits(got, head), logits, atol=atol, rtol=atol)
    first_draft = int(logits[-1].argmax())
    # the next step's chain: position L reads draft 1 and the MTP layer's own output at L - 1
    ids, got_positions, got = calls[1]
    assert ids.tolist() == [first_draft] and got_positions.tolist() == [length]
    x_chain = torch.cat([x, ref.inputs(torch.tensor([first_draft]), torch.tensor([length]), g[-1:])])
    _, chain_logits = ref.run(x_chain)
    torch.testing.assert_close(model.mtp.compute_logits(got, head), chain_logits[-1:], atol=atol, rtol=atol)
