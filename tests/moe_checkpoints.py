"""Tiny random mixture-of-experts checkpoints in the released Hugging Face layouts.

write_qwen3_moe: a Qwen3-MoE (as Qwen3-30B-A3B): each expert's projections stored one tensor each,
model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight, the router mlp.gate.weight (E, D),
a flat rope_theta and rope_scaling null, num_experts (not transformers 5's num_local_experts).
write_qwen3_5_moe: a Qwen3.5-MoE (as Qwen3.5-35B-A3B): every layer a MoE with the experts stacked,
mlp.experts.gate_up_proj (E, 2I, D) (gate rows first) and mlp.experts.down_proj (E, D, I), a
shared expert and its sigmoid gate mlp.shared_expert_gate.weight (1, D); the multi-token-prediction
layer a MoE too, its experts one tensor each (mtp.layers.0.mlp.experts.{e}.*, as released).

Both start from the dense fixtures (conftest.py: same attention, norms, tokenizer and files) and
put experts where the dense MLP was. Each expert's matrices have standard deviation 1/sqrt(fan_in),
as the dense ones, so activations stay of order 1. A router as small as transformers' init (std
0.02) gives near-uniform scores (1/8 +- 2%), so a rounding could flip a choice; this one's logits
have a standard deviation of about ROUTER_GAIN. Which experts a prompt reaches also depends on the
prompt: the tokens' hidden states share a component that gives each expert a fixed offset. With
seed 0 every expert of every layer is chosen within the first 20 tokens of the tests' TEXT (31
tokens); over seeds 0-9, within all 31 tokens in 9 of 10 Qwen3-MoE and 10 of 10 Qwen3.5-MoE.

The weights are drawn with numpy and written with MLX, as the dense fixtures are: no PyTorch.
"""
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from conftest import write_checkpoint, write_qwen35
from test_cli_errors import save_weights

# Qwen3-30B-A3B: 128 experts, 8 per token, moe_intermediate_size 768, all 48 layers MoE.
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
# Qwen3.5-35B-A3B: 256 experts, 8 per token, moe and shared expert intermediate sizes 512. Here
# the two differ (and differ from hidden 64); both are multiples of 32, the quantization group the
# tests use: mlx-lm's convert leaves a matrix whose rows are not a multiple of it unquantized.
MOE35 = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=128)
ROUTER_GAIN = 4.0  # router logits of standard deviation ~4 (x has a mean square of ~1)


def moe_layers(config):
    """Qwen3-MoE's rule (transformers' and mlx-lm's alike): which layers hold experts."""
    return [i for i in range(config["num_hidden_layers"]) if i not in config["mlp_only_layers"]
            and config["num_experts"] > 0 and (i + 1) % config["decoder_sparse_step"] == 0]


def _moe(rng, prefix, c, cast, stacked, shared):
    """A MoE block's tensors under prefix ("...mlp."): router, experts, and the shared expert."""
    d, e, i = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]

    def normal(shape, std):
        return mx.array(rng.normal(0, std, shape).astype(np.float32)).astype(cast)

    gate, up, down = normal((e, i, d), d ** -0.5), normal((e, i, d), d ** -0.5), normal((e, d, i), i ** -0.5)
    out = {prefix + "gate.weight": normal((e, d), ROUTER_GAIN * d ** -0.5)}
    if stacked:
        out[prefix + "experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        out[prefix + "experts.down_proj"] = down
    else:
        for x, name in [(gate, "gate_proj"), (up, "up_proj"), (down, "down_proj")]:
            out.update({f"{prefix}experts.{n}.{name}.weight": x[n] for n in range(e)})
    if shared:
        s = c["shared_expert_intermediate_size"]
        out.update({prefix + "shared_expert.gate_proj.weight": normal((s, d), d ** -0.5),
                    prefix + "shared_expert.up_proj.weight": normal((s, d), d ** -0.5),
                    prefix + "shared_expert.down_proj.weight": normal((d, s), s ** -0.5),
                    prefix + "shared_expert_gate.weight": normal((1, d), d ** -0.5)})
    return out


def _swap_mlps(folder, prefixes, moe):
    """In model.safetensors, drop the dense MLP under each prefix and add the tensors moe."""
    path = str(Path(folder) / "model.safetensors")
    weights = mx.load(path)
    for prefix in prefixes:
        for name in ["gate_proj", "up_proj", "down_proj"]:
            del weights[f"{prefix}{name}.weight"]
    save_weights(path, {**weights, **moe}, metadata={"format": "pt"})  # (not over what is read)


def write_qwen3_moe(folder, tokenizer, dtype="float32", seed=0, **overrides):
    """A random Qwen3-MoE: 3 layers of 8 experts (2 per token) unless overridden. overrides: any
    write_checkpoint() option (lm_head, rope, init) or config value, e.g. norm_topk_prob=False,
    mlp_only_layers=[1] or decoder_sparse_step=2 for dense layers among the MoE ones (their MLP
    intermediate_size wide). One safetensors file (no shards)."""
    folder = write_checkpoint(folder, tokenizer, dtype=dtype, seed=seed, **{**MOE, **overrides})
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                  output_router_logits=False, router_aux_loss_coef=0.001)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    rng, prefixes, moe = np.random.default_rng([seed, 1]), [], {}
    for i in moe_layers(config):
        prefixes.append(f"model.layers.{i}.mlp.")
        moe.update(_moe(rng, prefixes[-1], config, getattr(mx, dtype), stacked=False, shared=False))
    _swap_mlps(folder, prefixes, moe)
    return folder


def write_qwen3_5_moe(folder, tokenizer, dtype="float32", seed=0, mtp=True, tied=False, **overrides):
    """A random Qwen3.5-MoE: layers 0-2 Gated DeltaNet, 3 full attention (as write_qwen35), each
    with 8 experts (2 per token) and a shared expert; untied LM head as released (tied=True to
    tie). mtp: the multi-token-prediction head, its layer a MoE (False: none, as mlx-lm's
    conversions leave it). overrides: write_qwen35() options or text_config values."""
    folder = write_qwen35(folder, tokenizer, dtype=dtype, tied=tied, seed=seed,
                          mtp="random" if mtp else "none", **{**MOE35, **overrides})
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    del text["intermediate_size"]  # the release has none: every layer is a MoE
    text.update(model_type="qwen3_5_moe_text", output_router_logits=False, mtp_use_dedicated_embeddings=False)
    config.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    rng, cast, moe = np.random.default_rng([seed, 1]), getattr(mx, dtype), {}
    prefixes = [f"model.language_model.layers.{i}.mlp." for i in range(text["num_hidden_layers"])]
    for prefix in prefixes:
        moe.update(_moe(rng, prefix, text, cast, stacked=True, shared=True))
    if mtp:  # the released file stores this layer's experts one tensor each
        prefixes.append("mtp.layers.0.mlp.")
        moe.update(_moe(rng, prefixes[-1], text, cast, stacked=False, shared=True))
    _swap_mlps(folder, prefixes, moe)
    return folder
