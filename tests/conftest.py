"""Fixtures: tiny random-weight Qwen3 checkpoints in the real Hugging Face layout.

Each checkpoint is a folder with config.json (the real Qwen3 keys), generation_config.json,
tokenizer.json (a byte-level BPE trained here with the `tokenizers` library, special tokens
appended after the learned vocabulary as in Qwen's) and model.safetensors (or shards).
Like Qwen3-0.6B, heads x head_dim != hidden_size and the embedding has more rows than the
tokenizer has tokens.
"""
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK = ["<think>", "</think>"]  # added tokens that decode() keeps, as in Qwen3's tokenizer
CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Once upon a time there was a small model that learned to write text, one token at a time.",
    "日本の首都は東京です。中国的首都是北京。 한국의 수도는 서울입니다.",
    "Emoji: 😀 👍🏽 ❤️ 🇫🇷 and numbers 0123456789, tabs\tand\nnew lines.",
    "def f(x):\n    return x * 2  # code, too",
] * 20

# Qwen3-0.6B's exact shapes, for checkpoints of its size (tests/random_checkpoint.py, benchmark.py).
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)
# Tiny Qwen3: 4 query heads x head_dim 32 = 128 != hidden 64; 2 KV heads (GQA groups of 2).
TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=640, max_position_embeddings=2048)


# tokenizer_config.json's chat template, written here (not Qwen's file) by Qwen3's rules for what
# chat_prompt() covers: system, user and assistant turns; an earlier answer keeps only what follows
# its </think>; enable_thinking=False adds an empty think block. The real file's template is
# checked by tests/test_real_weights.py against a downloaded checkpoint.
CHAT_TEMPLATE = (
    "{%- for message in messages %}{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def build_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(SPECIALS)  # ids after the learned ones, like Qwen's 151643..
    tok.add_tokens(THINK)
    return tok


def write_checkpoint(folder, tokenizer, dtype="float32", lm_head="untied", rope="flat", shards=1,
                     seed=0, eos_extra=None, init="unit", **overrides):
    """Write a random-weight Qwen3 checkpoint into folder and return it.
    lm_head: "untied" (own lm_head.weight), "tied" (tie_word_embeddings, no lm_head.weight),
    "tied_stored" (tie_word_embeddings with a copy stored, as the released Qwen3-0.6B file).
    init: "unit" scales every matrix so that activations are of order 1 (logits spread widely,
    so greedy choices are clear-cut); "realistic" draws embeddings and projections with standard
    deviation 0.02, as Qwen3's initializer_range and its trained weights have: activations are
    small, and rms_norm's eps (1e-6 against a mean square of ~4e-4) changes the numbers; "wide"
    is "realistic" with an embedding and LM head of std 4 / sqrt(hidden), so that the logits
    have a standard deviation of about 4, as a trained model's do (their top two are close)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = dict(TINY, **overrides)
    d, f, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    rng = np.random.default_rng(seed)
    to_mx = lambda a: mx.array(a.astype(np.float32)).astype(getattr(mx, dtype))  # noqa: E731

    def mat(rows, cols, gain=1.0):  # "unit": std gain/sqrt(fan_in), activations stay O(1)
        return to_mx(rng.normal(0, gain / np.sqrt(cols) if init == "unit" else 0.02, (rows, cols)))

    def norm(n):  # norm weights near 1, not all equal, so a wrong norm shows
        return to_mx(1.0 + 0.2 * rng.normal(size=n))

    embed_std = {"unit": 1.0, "realistic": 0.02, "wide": 4.0 / np.sqrt(d)}[init]
    arrays = {"model.embed_tokens.weight": to_mx(rng.normal(0, embed_std, (v, d))), "model.norm.weight": norm(d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        arrays.update({
            p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
            p + "self_attn.q_proj.weight": mat(q, d, 2.0), p + "self_attn.k_proj.weight": mat(kv, d, 2.0),
            p + "self_attn.v_proj.weight": mat(kv, d), p + "self_attn.o_proj.weight": mat(d, q),
            p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": mat(f, d), p + "mlp.up_proj.weight": mat(f, d),
            p + "mlp.down_proj.weight": mat(d, f)})
    if lm_head == "untied":
        scale = np.where(np.arange(v) < tokenizer.get_vocab_size(), 1.0, 0.3)[:, None]  # padding rows:
        head_std = 0.02 if init == "realistic" else 4.0 / np.sqrt(d)  # "unit", "wide": logits ~4
        arrays["lm_head.weight"] = to_mx(rng.normal(0, head_std, (v, d)) * scale)  # rarely chosen
    elif lm_head == "tied_stored":
        arrays["lm_head.weight"] = arrays["model.embed_tokens.weight"]
    names = sorted(arrays)
    if shards == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), arrays, metadata={"format": "pt"})
    else:
        index = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: arrays[k] for k in names[s::shards]}
            index.update({k: fname for k in part})
            mx.save_safetensors(str(folder / fname), part, metadata={"format": "pt"})
        total = sum(a.nbytes for a in arrays.values())  # the real index format
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": index}))
    ids = {t: tokenizer.token_to_id(t) for t in SPECIALS}
    rope_cfg = {"rope_theta": 1000000.0, "rope_scaling": None} if rope == "flat" else \
        {"rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
              "attention_dropout": 0.0, "bos_token_id": ids["<|endoftext|>"],
              "eos_token_id": ids["<|im_end|>"], "hidden_act": "silu", "initializer_range": 0.02,
              "max_window_layers": c["num_hidden_layers"], "rms_norm_eps": 1e-6,
              "sliding_window": None, "use_sliding_window": False, "use_cache": True,
              "tie_word_embeddings": lm_head != "untied", "torch_dtype": dtype,
              **rope_cfg, **c}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    gen_eos = [ids["<|im_end|>"], ids["<|endoftext|>"]] + list(eos_extra or [])
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": gen_eos, "do_sample": True,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95}, indent=2))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
         "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": c["max_position_embeddings"],
         "clean_up_tokenization_spaces": False, "split_special_tokens": False}, indent=2))
    return folder


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


def once_per_options(tmp_path_factory, tokenizer, write, name):
    """A factory: make(**options) calls write() once per option set, in a fresh folder, and
    returns that folder."""
    made = {}

    def make(**options):
        key = json.dumps(options, sort_keys=True)
        if key not in made:
            made[key] = write(tmp_path_factory.mktemp(name), tokenizer, **options)
        return made[key]

    return make


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tokenizer):
    """A factory: checkpoint(**options) writes (once per option set) and returns a folder."""
    return once_per_options(tmp_path_factory, tokenizer, write_checkpoint, "qwen3")


def pytest_configure(config):
    """Show every skip's reason in the summary: the real-weights tests say how to enable them."""
    if "s" not in config.option.reportchars:
        config.option.reportchars += "s"


# Tiny Qwen3.5: layers 0-2 Gated DeltaNet, layer 3 gated full attention (0.8B: 18 and 6 of 24).
# The DeltaNet has fewer key heads than value heads (2 and 4: each key head serves two value
# heads), which 0.8B does not (16 and 16), so that a wrong pairing shows.
TINY35 = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, vocab_size=640, max_position_embeddings=2048,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=24, linear_conv_kernel_dim=4)
QWEN35_08B = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=256, vocab_size=248320, max_position_embeddings=262144,
                  linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4)

# Qwen3.5's chat template for what chat_prompt() covers, written by its rules (the small models'
# template): every content trimmed; an earlier answer keeps what follows its </think>; the answer
# opens an empty think block unless enable_thinking is true. The checkpoint's own is checked by
# tests/test_real_weights.py.
CHAT_TEMPLATE_35 = (
    "{%- for message in messages %}{%- set content = message.content|trim %}"
    "{%- if message.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is true %}{{- '<think>\\n' }}"
    "{%- else %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def write_qwen35(folder, tokenizer, dtype="float32", tied=True, seed=0, layer_types=None, mtp="random",
                 layers_scale=1.0, **overrides):
    """A random-weight Qwen3.5 checkpoint in the Hugging Face layout of the release: config.json
    with its text_config (and a vision_config), weights under model.language_model.*, the vision
    tower's and the multi-token predictor's tensors there to be skipped, the five norms that
    Qwen3.5 stores as offsets from 1 stored so (the DeltaNet's gated norm as a gain), the
    convolution as (channels, 1, kernel), A_log in float32.
    mtp: the multi-token-prediction head's 15 tensors, "random"; "agree", built to agree with the
    model: fc passes the token's embedding on, its layer adds nothing, its final norm is the
    model's, so it drafts the model's own next token after x_t+1 as if the model's layers added
    nothing (all of its drafts stand when
    layers_scale, a factor on every layer's output projections, is 0); or "none", as mlx-lm's
    conversions leave it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = dict(TINY35, **overrides)
    n = c["num_hidden_layers"]
    layer_types = layer_types or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    d, f, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    keys, values = hk * c["linear_key_head_dim"], hv * c["linear_value_head_dim"]
    conv, kernel = 2 * keys + values, c["linear_conv_kernel_dim"]
    rng = np.random.default_rng(seed)
    cast = getattr(mx, dtype)

    def normal(shape, std):
        return mx.array(rng.normal(0, std, shape).astype(np.float32)).astype(cast)

    def mat(rows, cols, gain=1.0):
        return normal((rows, cols), gain / np.sqrt(cols))

    def offset(size):  # a gain near 1, stored as gain - 1
        return normal((size,), 0.2)

    p = "model.language_model."
    arrays = {p + "embed_tokens.weight": normal((v, d), 1.0), p + "norm.weight": offset(d)}
    for i, kind in enumerate(layer_types):
        layer = f"{p}layers.{i}."
        arrays.update({layer + "input_layernorm.weight": offset(d),
                       layer + "post_attention_layernorm.weight": offset(d),
                       layer + "mlp.gate_proj.weight": mat(f, d), layer + "mlp.up_proj.weight": mat(f, d),
                       layer + "mlp.down_proj.weight": mat(d, f, layers_scale)})
        if kind == "full_attention":
            a = layer + "self_attn."
            arrays.update({a + "q_proj.weight": mat(2 * q, d, 2.0), a + "k_proj.weight": mat(kv, d, 2.0),
                           a + "v_proj.weight": mat(kv, d), a + "o_proj.weight": mat(d, q, layers_scale),
                           a + "q_norm.weight": offset(hd), a + "k_norm.weight": offset(hd)})
        else:
            a = layer + "linear_attn."
            arrays.update({a + "in_proj_qkv.weight": mat(conv, d, 2.0), a + "in_proj_z.weight": mat(values, d),
                           a + "in_proj_b.weight": mat(hv, d), a + "in_proj_a.weight": mat(hv, d),
                           a + "conv1d.weight": normal((conv, 1, kernel), 0.5),
                           a + "dt_bias": normal((hv,), 0.5),
                           a + "A_log": mx.array(np.log(rng.uniform(1, 16, hv)).astype(np.float32)),
                           a + "norm.weight": 1 + normal((c["linear_value_head_dim"],), 0.2),  # a gain
                           a + "out_proj.weight": mat(d, values, layers_scale)})
    if not tied:
        arrays["lm_head.weight"] = mat(v, d, 4.0)
    arrays.update({"model.visual.patch_embed.proj.weight": normal((32, 3, 2, 4, 4), 0.02),
                   "model.visual.blocks.0.attn.qkv.weight": normal((96, 32), 0.02)})
    if mtp != "none":  # top-level mtp.*, its norms offsets from 1 like the model's
        agree = mtp == "agree"
        m = "mtp.layers.0."
        zero = mx.zeros((d,), cast)  # an offset of 0: a gain of 1
        arrays.update({
            "mtp.fc.weight": mx.concatenate([mx.eye(d), mx.zeros((d, d))], 1).astype(cast) if agree
            else mat(d, 2 * d), "mtp.pre_fc_norm_embedding.weight": zero if agree else offset(d),
            "mtp.pre_fc_norm_hidden.weight": zero if agree else offset(d),
            "mtp.norm.weight": arrays[p + "norm.weight"] if agree else offset(d),  # the model's gain
            m + "input_layernorm.weight": offset(d), m + "post_attention_layernorm.weight": offset(d),
            m + "self_attn.q_proj.weight": mat(2 * q, d, 2.0), m + "self_attn.k_proj.weight": mat(kv, d),
            m + "self_attn.v_proj.weight": mat(kv, d), m + "self_attn.q_norm.weight": offset(hd),
            m + "self_attn.o_proj.weight": mat(d, q, 0.0 if agree else 1.0),
            m + "self_attn.k_norm.weight": offset(hd), m + "mlp.gate_proj.weight": mat(f, d),
            m + "mlp.up_proj.weight": mat(f, d), m + "mlp.down_proj.weight": mat(d, f, 0.0 if agree else 1.0)})
    mx.save_safetensors(str(folder / "model.safetensors"), arrays, metadata={"format": "pt"})
    ids = {t: tokenizer.token_to_id(t) for t in SPECIALS}
    text = {**c, "model_type": "qwen3_5_text", "layer_types": layer_types, "attention_bias": False,
            "attn_output_gate": True, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": tied,
            "full_attention_interval": 4, "eos_token_id": ids["<|endoftext|>"], "dtype": dtype,
            "mtp_num_hidden_layers": 0 if mtp == "none" else 1, "mamba_ssm_dtype": "float32",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                "mrope_interleaved": True, "mrope_section": [1, 1, 2]}}
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "tie_word_embeddings": tied, "text_config": text, "image_token_id": v - 4,
              "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": d}}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "temperature": 1.0, "top_p": 1.0}))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "chat_template": CHAT_TEMPLATE_35, "eos_token": "<|im_end|>",
         "pad_token": "<|endoftext|>", "bos_token": None, "split_special_tokens": False}, indent=2))
    return folder


@pytest.fixture(scope="session")
def qwen35(tmp_path_factory, tokenizer):
    """A factory: qwen35(**options) writes (once per option set) and returns a Qwen3.5 folder."""
    return once_per_options(tmp_path_factory, tokenizer, write_qwen35, "qwen35")


@pytest.fixture(scope="session")
def qwen3_moe(tmp_path_factory, tokenizer):
    """A factory: qwen3_moe(**options), a tiny Qwen3-MoE (tests/moe_checkpoints.py), once each."""
    from moe_checkpoints import write_qwen3_moe
    return once_per_options(tmp_path_factory, tokenizer, write_qwen3_moe, "qwen3_moe")


@pytest.fixture(scope="session")
def qwen35_moe(tmp_path_factory, tokenizer):
    """A factory: qwen35_moe(**options), a tiny Qwen3.5-MoE with its shared expert, once each."""
    from moe_checkpoints import write_qwen3_5_moe
    return once_per_options(tmp_path_factory, tokenizer, write_qwen3_5_moe, "qwen35_moe")
