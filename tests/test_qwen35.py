"""Qwen3.5 (issue 23): the Gated DeltaNet and the gated attention against mlx-lm's qwen3_5 on
tiny random checkpoints in the release's Hugging Face layout (a text_config, layer_types,
model.language_model.* names, norms stored as offsets from 1, the convolution as (C, 1, K), vision
and multi-token-prediction tensors to skip), and in mlx-lm's own layout (its convert(), plain
and 4-bit). Layers 0-2 are DeltaNet, layer 3 full attention; the DeltaNet has 2 key heads and 4
value heads, so that a wrong pairing of the two shows (0.8B's counts are equal, 16 and 16).

Exactness is proven in float32, where mlx-lm and transformers add the norms' 1 alike; in
bfloat16 two correct implementations round differently, and ours must be as close to the exact
answer as mlx-lm's own.
"""
import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.convert import convert
from mlx_lm.tokenizer_utils import load as load_tokenizer

import llm_inference as li
from test_cli_errors import assert_error, run_cli, save_weights
from test_model import (TEXT, assert_generate_agrees, greedy_along_mlx_lm, mlx_lm_greedy,
                        mlx_lm_logits, ours_logits, rel_err)


@pytest.fixture(scope="module")
def converted(qwen35, tmp_path_factory):
    """mlx-lm's convert() of an untied float32 Qwen3.5 (quantize: 4 bits, groups of 32): names
    language_model.model.*, norms already gains, the convolution (C, K, 1), no vision, no MTP."""
    made = {}

    def make(quantize):
        if quantize not in made:
            made[quantize] = tmp_path_factory.mktemp("converted") / f"q{quantize}"
            convert(str(qwen35(tied=False)), str(made[quantize]), dtype="float32",
                    quantize=bool(quantize), q_bits=4, q_group_size=32)
        return made[quantize]
    return make


@pytest.mark.parametrize("layout", ["hf-tied", "hf-untied", "hf-equal-heads", "mlx", "mlx-4bit"])
def test_float32_logits_equal_mlx_lm(qwen35, converted, tokenizer, layout):
    """float32, three DeltaNet layers and one gated attention: summation order and mlx-lm's fused
    kernels (rms_norm, rope, sdpa) against the formulas written out: measured 2e-7. A norm left
    as an offset, a DeltaNet norm given one, a key head paired with the wrong value heads, the
    decay's sign: 1e-2 or more."""
    if layout.startswith("mlx"):
        folder = converted(4 if layout == "mlx-4bit" else 0)
    else:
        folder = qwen35(**{"hf-tied": {}, "hf-untied": dict(tied=False),
                           "hf-equal-heads": dict(linear_num_value_heads=2)}[layout])
    ids = tokenizer.encode(TEXT).ids
    ref = mlx_lm_logits(folder, ids)
    ours = ours_logits(folder, ids)
    assert ours.shape == ref.shape == (len(ids), 640) and ours.dtype == mx.float32
    assert li.QWEN35["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert rel_err(ours, ref) < 1e-4
    assert (mx.argmax(ours, -1) == mx.argmax(ref, -1)).all().item()


@pytest.mark.parametrize("options", [dict(), dict(tied=False), dict(linear_num_value_heads=2)])
def test_float32_logits_equal_transformers(qwen35, tokenizer, options):
    """transformers' Qwen3_5ForConditionalGeneration on the same folder (its vision tower, which
    this tiny folder does not fit, is set aside): measured 1e-6 to 6e-6 relative."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = qwen35(**options)
    ids = tokenizer.encode(TEXT).ids
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, ignore_mismatched_sizes=True).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    assert rel_err(ours_logits(folder, ids), mx.array(ref)) < 1e-4


def test_bfloat16_as_accurate_as_mlx_lm(qwen35, tokenizer):
    """bfloat16: the exact answer is the same bfloat16 weights in float32 (mlx-lm's, its norms'
    1 added in bfloat16, as ours is, before any cast). Ours no further from it than mlx-lm's own
    bfloat16 logits, give or take a factor of 2; with --dtype float32, equal to it. The
    recurrence's state stays float32 (A_log is stored so)."""
    folder = qwen35(dtype="bfloat16")
    ids = tokenizer.encode(TEXT).ids
    ours = ours_logits(folder, ids)
    assert ours.dtype == mx.bfloat16 and li.W["model.layers.0.linear_attn.A_log"].dtype == mx.float32
    cache = [None] * li.N_LAYERS
    li.forward(ids[:3], cache, 0)
    assert cache[0][0].dtype == mx.bfloat16 and cache[0][1].dtype == mx.float32
    ref_bf16, exact = mlx_lm_logits(folder, ids), mlx_lm_logits(folder, ids, dtype=mx.float32)
    err_ours, err_ref = rel_err(ours, exact), rel_err(ref_bf16, exact)
    print(f"bf16 error vs exact: ours {err_ours:.2e}, mlx-lm {err_ref:.2e}")
    assert 0 < err_ours <= 2 * err_ref
    li.load(folder, mx.float32)  # --dtype float32: the same gains (1 added before the cast)
    assert rel_err(li.forward(ids, [None] * li.N_LAYERS, 0), exact) < 1e-4


@pytest.mark.parametrize("steps", [[5] + [1] * 26, [7, 9, 15], [1, 1, 29], [30, 1]])
def test_cached_steps_equal_one_forward(qwen35, tokenizer, steps):
    """Prefill then decode, and chunks on a non-empty cache: the convolution's last 3 inputs and
    the recurrent state carry across calls (from the second call on they matter)."""
    li.load(qwen35())
    ids = tokenizer.encode(TEXT).ids[:sum(steps)]
    full = li.forward(ids, [None] * li.N_LAYERS, 0)
    cache, rows, pos = [None] * li.N_LAYERS, [], 0
    for n in steps:
        rows.append(li.forward(ids[pos:pos + n], cache, pos))
        pos += n
    assert rel_err(mx.concatenate(rows), full) < 1e-5
    conv_state, state = cache[0]
    assert conv_state.shape == (3, 2 * 2 * 16 + 4 * 24) and state.shape == (4, 16, 24)
    assert cache[3][0].shape == (2, 256, 32)  # the full-attention layer: keys (KV, room, hd)


def test_chunked_prefill_equals_one_forward(qwen35, tokenizer):
    li.load(qwen35())
    ids = tokenizer.encode(TEXT).ids  # 31 tokens: chunks of 8, 8, 8, 6, then the last token
    full = li.forward(ids, [None] * li.N_LAYERS, 0)[-1]
    assert rel_err(li.prefill(ids, [None] * li.N_LAYERS, chunk=8), full) < 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_generation_equals_mlx_lm(qwen35, tokenizer, dtype):
    """Teacher-forced along mlx-lm's greedy ids (test_model.greedy_along_mlx_lm: ties within one
    step of the dtype are not compared); generate() agrees up to the first tie."""
    folder = qwen35(dtype=dtype, tied=False)
    ids = tokenizer.encode("The capital of France is").ids
    ref, top2s, ref_logits = mlx_lm_greedy(folder, ids, 24)
    li.load(folder)
    agreed = greedy_along_mlx_lm(ids, ref, top2s, ref_logits)
    assert len(set(ref)) > 5
    assert_generate_agrees(ids, 24, ref, agreed)


def test_stopping_on_eos_leaves_the_state_of_what_was_yielded(qwen35, tokenizer):
    """generate() queues the token after an EOS id before it sees the EOS: a recurrent state
    absorbs it. It must be taken back: the cache afterwards equals a fresh run of prompt + reply,
    and a turn that extends it equals a fresh run of the whole."""
    li.load(qwen35(tied=False))  # (tied, this tiny model repeats one token)
    ids = tokenizer.encode("The capital of France is").ids
    free_run = list(li.generate(ids, max_tokens=12))
    li.EOS_IDS = {free_run[6]} if free_run[6] not in free_run[:6] else {free_run[5]}
    cache = [None] * li.N_LAYERS
    reply = list(li.generate(ids, max_tokens=12, cache=cache))
    assert len(reply) in (5, 6) and reply == free_run[:len(reply)]
    fresh = [None] * li.N_LAYERS
    mx.eval(li.forward(ids + reply, fresh, 0))
    held = len(ids) + len(reply)
    for (a, b), (fa, fb), kind in zip(cache, fresh, li.QWEN35["layer_types"]):
        if kind == "full_attention":
            a, b, fa, fb = a[:, :held], b[:, :held], fa[:, :held], fb[:, :held]
        assert rel_err(a, fa) < 1e-5 and rel_err(b, fb) < 1e-5
    more = ids + reply + tokenizer.encode(" And Japan's is").ids
    li.EOS_IDS = set()
    turn = list(li.generate(more[held:], max_tokens=6, cache=cache, start=held))
    assert turn == list(li.generate(more, max_tokens=6))


def test_delta_step_by_hand():
    """One token through the delta rule, element by element, in numpy: forget (S *= decay),
    recall (k S), correct (S += k^T beta (v - k S)), read (q S). 2 heads, dk 3, dv 2."""
    rng = np.random.default_rng(0)
    S = rng.normal(size=(2, 3, 2)).astype(np.float32)
    q, k = rng.normal(size=(2, 3)).astype(np.float32), rng.normal(size=(2, 3)).astype(np.float32)
    v = rng.normal(size=(2, 2)).astype(np.float32)
    decay, beta = np.array([0.9, 0.5], np.float32), np.array([0.3, 1.0], np.float32)
    want_S, want_y = np.zeros_like(S), np.zeros_like(v)
    for h in range(2):
        for j in range(2):
            recalled = sum(k[h, i] * decay[h] * S[h, i, j] for i in range(3))
            for i in range(3):
                want_S[h, i, j] = decay[h] * S[h, i, j] + k[h, i] * beta[h] * (v[h, j] - recalled)
            want_y[h, j] = sum(q[h, i] * want_S[h, i, j] for i in range(3))
    got_S, got_y = li.delta_step(*(mx.array(a) for a in (S, q, k, v, decay, beta)))
    assert np.allclose(np.array(got_S), want_S, atol=1e-6)
    assert np.allclose(np.array(got_y), want_y, atol=1e-6)
    # a unit key, written fully (beta 1) into an empty state: S holds v along k, q = k reads v
    e = mx.array([[0.0, 1.0, 0.0]] * 2)
    got_S, got_y = li.delta_step(mx.zeros((2, 3, 2)), e, e, mx.array(v), mx.ones(2), mx.ones(2))
    assert np.allclose(np.array(got_y), v) and np.allclose(np.array(got_S[:, 1]), v)


def test_command_line_plain_explain_and_memories(qwen35, tokenizer):
    """The summary says what of Qwen3.5 runs; the KV cache line counts the one full-attention
    layer's keys and values (growing), the DeltaNet line the 3 layers' fixed states; --explain
    (which runs the prompt into the cache first) changes nothing of the text."""
    folder = qwen35(tied=False)
    plain = run_cli("--model", str(folder), "-m", "6")
    explained = run_cli("--model", str(folder), "-m", "6", "--explain")
    assert plain.returncode == explained.returncode == 0 and plain.stderr == "", plain.stderr
    assert plain.stdout.startswith(
        f"Qwen3.5 from {folder} (text only: its vision tower is not run; an MTP head to draft "
        "with): 4 layers, 3 of them Gated DeltaNet, hidden 64, 4 query / 2 KV heads x 32, ")
    text = plain.stdout.split("==========\n")[1]
    assert text.startswith("The capital of France is") and text in explained.stdout
    grid = explained.stdout.split("the answer forming")[1]
    assert len(re.findall(r"\nblock \d ", grid)) == 4  # the logit lens: every layer
    li.load(folder)
    ids = tokenizer.encode("The capital of France is").ids
    held = len(ids) + len(list(li.generate(ids, max_tokens=6)))
    kv = held * 1 * 2 * 2 * 32 * 4                                    # 1 layer x (k, v) x 2 x 32
    states = 3 * (3 * 160 + 4 * 16 * 24) * 4                          # conv and state, float32
    assert (f"KV cache: {held} positions, {kv / 1e6:.3f} MB ({256 * 2 * 2 * 32 * 4 / 1e6:.3f} MB "
            f"allocated)\nDeltaNet state: 3 layers, {states / 1e6:.3f} MB at any length") in plain.stdout


@pytest.mark.parametrize("flag, draft", [("--think", []), ("--no-think", []), (None, []),
                                        ("--think", ["--draft", "mtp"])])
def test_conversation_turn_equals_a_fresh_run(qwen35, tokenizer, flag, draft):
    """A recurrent state cannot be cut back to a common prefix, and the template drops the answer's
    thinking, so the next prompt parts from the cache right after "<|im_start|>assistant\n": the
    cache is kept as it was there, and the next turn goes on from it (every turn reuses all the
    conversation up to that answer). Each reply equals a fresh run of its whole prompt. With no
    flag, thinking is the template's default: off (the fixture's is Qwen3.5-0.8B's kind)."""
    folder = qwen35(tied=False)
    think = flag == "--think"
    flags = ([flag] if flag else []) + draft  # drafting: the same ids, the same reuse
    r = run_cli("--model", str(folder), "--chat", "-m", "6", *flags,
                stdin=b"Hello there\nAnd Japan?\nAnd Korea?\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    li.load(folder)
    turns, parts, previous = [], r.stdout.split("[KV cache: ")[1:], []
    opening = len(tokenizer.encode(li.chat_prompt([""], None, think)
                                   .split("<|im_start|>assistant\n")[-1]).ids)  # <think>...
    for n, (line, part) in enumerate(zip(["Hello there", "And Japan?", "And Korea?"], parts)):
        turns.append(line)
        ids = tokenizer.encode(li.chat_prompt(turns, None, think)).ids
        reused = len(previous) - opening if previous else 0  # all of the last prompt but that
        assert ids[:reused] == previous[:reused]
        assert part.startswith(f"{reused} tokens reused, {len(ids) - reused} new to prefill]")
        previous = ids
        answer = list(li.generate(ids, max_tokens=6))
        text = "".join(piece for _, piece in li.stream_text(answer))
        assert "==========\n" + text + "\n==========" in part
        turns.append(tokenizer.decode(answer))


@pytest.mark.parametrize("system", [None, "  You are terse. 🙂\n"])
@pytest.mark.parametrize("think", [True, False])
def test_chat_prompt_is_qwen35_template(qwen35, system, think):
    """chat_prompt() for Qwen3.5: its template (conftest.CHAT_TEMPLATE_35, its rules for what the
    script sends) as mlx-lm's tokenizer renders it: each text trimmed, an earlier answer's
    thinking dropped, the answer opened with "<think>\\n" when thinking."""
    folder = qwen35()
    li.load(folder)
    turns = ["  Hi 🇫🇷 ", "<think>\nA greeting.\n</think>\n\n Hello! ", "And Japan?\n"]
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": ("assistant" if i % 2 else "user"), "content": t} for i, t in enumerate(turns)]
    expected = load_tokenizer(Path(folder)).apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=think)
    assert li.tokenize(li.chat_prompt(turns, system, think)) == list(expected)


THINKING_OFF = "{%- if enable_thinking is defined and enable_thinking is true %}<think>{% endif %}"
THINKING_ON = "{%- if enable_thinking is defined and enable_thinking is false %}<think>{% endif %}"


@pytest.mark.parametrize("files, thinks", [
    ({}, True),  # no template: as before, thinking on
    ({"tokenizer_config.json": json.dumps({"chat_template": THINKING_ON})}, True),  # Qwen3's
    ({"tokenizer_config.json": json.dumps({"chat_template": THINKING_OFF})}, False),  # 0.8B, 2B
    ({"chat_template.jinja": THINKING_OFF}, False),
    ({"chat_template.jinja": THINKING_ON,  # the .jinja file first, as transformers reads them
      "tokenizer_config.json": json.dumps({"chat_template": THINKING_OFF})}, True)])
def test_thinking_follows_the_folders_template(tmp_path, files, thinks):
    """Qwen3.5-0.8B's and 2B's templates think only when enable_thinking is true, 4B's and larger
    (and Qwen3's) unless it is false: read from the template's text, never rendered."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert li.thinks_first(tmp_path) is thinks


@pytest.mark.parametrize("flags, think", [([], False), (["--think"], True), (["--no-think"], False)])
def test_chat_prompt_thinks_as_the_template_or_the_flag_says(qwen35, monkeypatch, flags, think):
    """--chat with a prompt on a folder whose template is the small models' (no thinking unless
    asked): the prompt sent is chat_prompt()'s with thinking off, unless --think."""
    folder = qwen35()
    sent = []

    def reply(ids, *args, **kwargs):  # the prompt's ids, never run
        sent.append(ids)

    monkeypatch.setattr(li, "reply", reply)
    li.main(["--model", str(folder), "--chat", "-p", "Hi", "-q", *flags])
    assert sent == [li.tokenize(li.chat_prompt(["Hi"], None, think))]
    assert li.chat_prompt(["Hi"], None, True) != li.chat_prompt(["Hi"], None, False)


@pytest.mark.parametrize("change, needle", [
    ({"layer_types": ["linear_attention"] * 3}, "layer_types must be a list of"),  # 4 layers
    ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, 'layer_types must be a list of'),
    ({"linear_conv_kernel_dim": None}, "has no 'linear_conv_kernel_dim' entry"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.3}},
     "partial_rotary_factor must be a fraction (0 to 1) of head_dim that is even"),  # 32 x 0.3: 9
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.01}},
     "partial_rotary_factor must be a fraction (0 to 1) of head_dim that is even"),  # 0 dimensions
    ({"mtp_num_hidden_layers": 2}, "mtp_num_hidden_layers must be 0 or 1"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0,
                                          "partial_rotary_factor": 0.25}}, "rope_parameters has no 'original_max_position"),
])
def test_config_errors(qwen35, tmp_path, change, needle):
    folder = Path(shutil.copytree(qwen35(), tmp_path / "model"))
    config = li.parse_json(folder / "config.json")
    config["text_config"].update(change)
    config["text_config"] = {k: v for k, v in config["text_config"].items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    assert_error(run_cli("--model", str(folder)), str(folder / "config.json"), needle)


def test_value_heads_that_do_not_fit_the_weights(qwen35, tmp_path):
    """config.json's DeltaNet sizes predict its tensors' shapes: 3 value heads, not the 4 stored."""
    folder = Path(shutil.copytree(qwen35(), tmp_path / "model"))
    config = li.parse_json(folder / "config.json")
    config["text_config"]["linear_num_value_heads"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    assert_error(run_cli("--model", str(folder)), "linear_attn.in_proj_qkv.weight has shape")


def test_missing_deltanet_tensor(qwen35, tmp_path):
    folder = Path(shutil.copytree(qwen35(), tmp_path / "model"))
    weights = mx.load(str(folder / "model.safetensors"))
    del weights["model.language_model.layers.1.linear_attn.A_log"]
    save_weights(folder / "model.safetensors", weights)
    assert_error(run_cli("--model", str(folder)), "tensor model.layers.1.linear_attn.A_log is missing",
                 "expected shape (4,)")


def test_download_by_repo_id(qwen35, tmp_path):
    """--model Qwen/Qwen3.5-0.8B from a stand-in Hub (tests/hub.py): the configs, the template,
    the tokenizer and the weights come into the Hugging Face cache (not the README), and the text
    equals the local folder's."""
    from hub import StandInHub
    from test_download import run
    folder = Path(shutil.copytree(qwen35(tied=False), tmp_path / "release"))
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "preprocessor_config.json").write_text("{}")
    (folder / "README.md").write_text("a model card")
    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copy(Path(li.__file__), clone)
    hub = StandInHub()
    try:
        hub.add_repo("Qwen/Qwen3.5-0.8B", folder, sorted(p.name for p in folder.iterdir()))
        r = run(clone, hub, "--model", "Qwen/Qwen3.5-0.8B")
    finally:
        hub.close()
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("Qwen/Qwen3.5-0.8B: asking ")  # before the first request
    assert sorted(line.split(":")[0] for line in lines[1:]) == sorted(
        ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
         "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"])
    assert r.stdout.split("==========")[1] == run_cli("--model", str(folder), "-m", "3").stdout.split(
        "==========")[1]


# ─── The DeltaNet's output gate as config.json names it; Qwen3.6's folders ───
# Qwen3.6-27B's text_config (model_type qwen3_5) carries "output_gate_type": "swish". Where
# transformers reads the entry (5.25: Qwen4-Exp's configuration and modeling) it is the
# activation of the Gated DeltaNet's output gate, norm(y) * act(z) (Qwen4ExpTextRMSNormGated:
# ACT2FN[output_gate_type or hidden_act]); the full attention's gate is sigmoid whatever it says.
# ACT2FN's "swish" is nn.SiLU, and "silu" the same function: what gated_delta_net() computes
# (rms_norm(y) * silu(z)). transformers' Qwen3.5 classes do not read the entry (their gated norm
# is silu always); Qwen4-Exp's checkpoints say "sigmoid": a gate this file does not compute.
# Megatron-Bridge names the same setting linear_attention_output_gate_activation (its
# provider's field, derived from output_gate_type or hidden_act).

GATE_ENTRIES = ["output_gate_type", "linear_attention_output_gate_activation"]


def with_text_config(folder, dest, **entries):
    """A copy of a Qwen3.5 folder whose text_config has entries (None: removed)."""
    dest = Path(shutil.copytree(folder, dest))
    config = li.parse_json(dest / "config.json")
    config["text_config"].update(entries)
    config["text_config"] = {k: v for k, v in config["text_config"].items() if v is not None}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


@pytest.mark.parametrize("entry", GATE_ENTRIES)
@pytest.mark.parametrize("value", ["swish", "silu"])
def test_the_deltanet_gate_computed_here_runs(qwen35, tokenizer, tmp_path, entry, value):
    """The entry naming the gate this file computes (SiLU, by either name) runs, and changes
    nothing: the same logits as the folder without it (the same weights and code: equal)."""
    plain = qwen35()
    folder = with_text_config(plain, tmp_path / "gated", **{entry: value})
    ids = tokenizer.encode(TEXT).ids
    ref = ours_logits(plain, ids)
    li.load_checked(folder)
    assert mx.array_equal(li.forward(ids, [None] * li.N_LAYERS, 0), ref)


@pytest.mark.parametrize("entry", GATE_ENTRIES)
@pytest.mark.parametrize("value", ["sigmoid", "gelu"])
def test_another_deltanet_gate_is_refused_in_one_line(qwen35, tmp_path, entry, value):
    """Another gate (Qwen4-Exp's sigmoid, say) would be another model: refused before any weight
    is read, in one line naming config.json, the entry and its value; exit status 1."""
    folder = with_text_config(qwen35(), tmp_path / "gated", **{entry: value})
    r = run_cli("--model", str(folder), "-m", "2")
    assert_error(r, str(folder / "config.json"), entry, f'"{value}"')
    assert r.returncode == 1 and r.stdout == ""
    with pytest.raises(li.UserError):
        li.load_checked(folder)


def qwen36_moe(qwen35_moe, dest, tokenizer, mtp_experts):
    """A Qwen3.6-35B-A3B-style folder from the Qwen3.5-MoE fixture: model_type qwen3_5_moe, its
    experts one fused gate_up_proj a block (as the fixture, and Qwen3.5-MoE, store them), and
    entries reported in Qwen3.6 config.json files: text_config's bos_token_id (35B-A3B; 3.5's has
    none), output_gate_type "swish" (27B), pad_token_id and partial_rotary_factor beside
    rope_parameters as well as in it; language_model_only and a newer transformers_version at
    the top. mtp_experts: the MTP layer's experts "separate" (one tensor each, as the
    Qwen3.5-MoE release) or "fused" (stacked as the model's)."""
    bos = tokenizer.token_to_id("<|endoftext|>")
    folder = with_text_config(qwen35_moe(), dest, bos_token_id=bos, pad_token_id=bos,
                              partial_rotary_factor=0.25, output_gate_type="swish")
    config = li.parse_json(folder / "config.json")
    config.update(language_model_only=False, transformers_version="4.57.1")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if mtp_experts == "fused":
        weights = dict(mx.load(str(folder / "model.safetensors")))
        e, m = config["text_config"]["num_experts"], "mtp.layers.0.mlp.experts."
        stacked = {p: mx.stack([weights.pop(f"{m}{n}.{p}_proj.weight") for n in range(e)])
                   for p in ("gate", "up", "down")}
        weights[m + "gate_up_proj"] = mx.concatenate([stacked["gate"], stacked["up"]], axis=1)
        weights[m + "down_proj"] = stacked["down"]
        save_weights(folder / "model.safetensors", weights, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("mtp_experts", ["separate", "fused"])
def test_a_qwen36_moe_folder_runs(qwen35_moe, tokenizer, tmp_path, mtp_experts):
    """Qwen3.6's mixtures are Qwen3.5-MoE's architecture and model_type (transformers' docs:
    "Qwen3.6 checkpoints share the same architecture and model_type as Qwen3.5 and are loaded
    with the same classes"): such a folder runs as one, its logits mlx-lm's (float32: 1e-4, as
    test_moe's), its MTP head's mixture read (either layout), and the command line says
    Qwen3.5-MoE."""
    folder = qwen36_moe(qwen35_moe, tmp_path / "qwen36", tokenizer, mtp_experts)
    ids = tokenizer.encode(TEXT).ids
    li.load_checked(folder)
    assert li.MODEL == "qwen3_5" and li.MOE["layers"] == list(range(li.N_LAYERS))
    assert li.W["model.layers.4.mlp.experts.gate_up_proj"].shape == (8, 64, 64)  # the MTP head's
    assert rel_err(li.forward(ids, [None] * li.N_LAYERS, 0), mlx_lm_logits(folder, ids)) < 1e-4
    r = run_cli("--model", str(folder), "-m", "4", "--draft", "mtp")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Qwen3.5-MoE from ")
