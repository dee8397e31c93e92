"""YaRN (a config.json rope_scaling, or rope_parameters, of "rope_type": "yarn"): the long-context
RoPE, against transformers and mlx-lm on tiny random checkpoints.

YaRN divides the slow pairs' frequencies by factor, keeps the fast ones, blends those between on a
ramp whose bounds come from beta_fast, beta_slow and original_max_position_embeddings, and scales
cos and sin by the attention factor (0.1 ln(factor) + 1 unless given). The tiny models use
factor 4 over an original 32 positions, prompts run past position 32, and each logits test also
checks that YaRN changed the logits by far more than the tolerance (so that YaRN ignored fails it).

References: transformers (torch) wherever it applies YaRN: Qwen3, Qwen3-MoE and Qwen3.5, every
entry (truncate, attention_factor). mlx-lm without torch: it applies YaRN to qwen3 and qwen3_5 (not
qwen3_moe, whose RoPE is plain there), and agrees with transformers when factor and
original_max_position_embeddings are given and truncate and attention_factor are not (it has
neither: it always rounds the ramp's bounds, and scales by 0.1 ln(factor) + 1 whatever is given).

Error measure for logits: test_model.rel_err, max |ours - ref| / max |ref| over the whole matrix.
"""
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

import llm_inference as li
from test_cli_errors import assert_error, run_cli
from test_model import TEXT, mlx_lm_logits, ours_logits, rel_err

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
LONG = 128  # factor x original: max_position_embeddings of the logits tests' folders, as Qwen's
# float32 against float32 (test_model.py's bound): summation order and fused kernels only. Measured
# here, |logits| up to 17 (Qwen3.5: 53): dense and MoE 7e-7 to 1e-6 against either reference;
# Qwen3.5 2e-7 against mlx-lm, 7e-6 against transformers at 60 tokens (its PyTorch Gated DeltaNet
# drifts with length, YaRN or not: 3e-6 at 31 tokens, 3e-5 at 100, hence 60 tokens there).
TOL = 1e-4
# YaRN's own effect must dwarf TOL, or a comparison could not tell YaRN from plain RoPE. Measured:
# dense 0.42, Qwen3-MoE 0.85, Qwen3.5 1.4e-2 (one attention layer of four, 8 of its 32 dims
# turned), Qwen3.5-MoE 5.4e-2.
EFFECT = 10 * TOL


def prompt_ids(tokenizer, n):
    ids = tokenizer.encode(TEXT * 5).ids[:n]
    assert len(ids) == n and n > YARN["original_max_position_embeddings"]  # past the original
    return ids


def with_yarn(folder, dest, yarn=YARN, **entries):
    """A copy of folder whose config.json has yarn where the folder keeps its RoPE: merged into
    rope_parameters where there is one (transformers 5's form; Qwen3.5's text_config), else as a
    flat rope_scaling (None: neither). entries: other config values (text_config's for Qwen3.5)."""
    dest = Path(shutil.copytree(folder, dest))
    cfg = json.loads((dest / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text.update(entries)
    if yarn is None:  # the RoPE as it is
        pass
    elif isinstance(text.get("rope_parameters"), dict):
        text["rope_parameters"] = {**text["rope_parameters"], **yarn}
    else:
        text["rope_scaling"] = dict(yarn)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest


@pytest.fixture
def model(checkpoint, qwen35, qwen3_moe, qwen35_moe):
    """model(kind) -> (the plain folder, its transformers class name, the prompt's length)."""
    def make(kind):
        return {"dense-flat": (checkpoint(), "Qwen3ForCausalLM", 100),
                "dense-nested": (checkpoint(rope="nested"), "Qwen3ForCausalLM", 100),
                "qwen3_moe": (qwen3_moe(), "Qwen3MoeForCausalLM", 100),
                "qwen3_5": (qwen35(), "Qwen3_5ForConditionalGeneration", 60),
                "qwen3_5_moe": (qwen35_moe(), "Qwen3_5MoeForConditionalGeneration", 60)}[kind]
    return make


def check_logits(plain, folder, ids, ref):
    """Ours on folder (YaRN) against ref, and YaRN's effect against ours on plain (no scaling)."""
    before = ours_logits(plain, ids)
    ours = ours_logits(folder, ids)
    assert li.YARN == {k: v for k, v in YARN.items() if k != "rope_type"}  # what it runs
    assert ours.dtype == mx.float32 and ours.shape == ref.shape == (len(ids), 640)
    effect, err = rel_err(before, ours), rel_err(ours, ref)
    print(f"YaRN's effect {effect:.2e}, error {err:.2e}")
    assert effect > EFFECT
    assert err < TOL


# ─── 1. Logits past original_max_position_embeddings, against transformers ───

@pytest.mark.parametrize("kind", ["dense-flat", "dense-nested", "qwen3_moe", "qwen3_5"])
def test_float32_logits_equal_transformers(model, tokenizer, tmp_path, kind):
    """transformers applies YaRN to all four (for qwen3_moe the only reference: mlx-lm's
    qwen3_moe ignores rope_scaling). Qwen3.5: the entry in text_config.rope_parameters, beside
    partial_rotary_factor and mrope_section."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    plain, cls, n = model(kind)
    folder = with_yarn(plain, tmp_path / "yarn", max_position_embeddings=LONG)
    ids = prompt_ids(tokenizer, n)
    kw = dict(ignore_mismatched_sizes=True) if "Conditional" in cls else {}  # its vision tower
    hf = getattr(transformers, cls).from_pretrained(folder, dtype=torch.float32, **kw).eval()
    assert hf.config.get_text_config().rope_parameters["rope_type"] == "yarn"
    with torch.no_grad():
        ref = mx.array(hf(torch.tensor([ids])).logits[0].numpy())
    check_logits(plain, folder, ids, ref)


# ─── 2. Logits against mlx-lm (no torch needed) ───

@pytest.mark.parametrize("kind, theta, yarn", [
    ("dense-flat", None, YARN), ("dense-nested", None, YARN),
    # a wider ramp (pairs 0-6 of 16, not 0-2): rope_theta 1e4, beta_fast 8, beta_slow 0.5
    ("dense-flat", 1e4, {**YARN, "beta_fast": 8, "beta_slow": 0.5}),
    ("qwen3_5", None, YARN), ("qwen3_5_moe", None, YARN)],
    ids=["dense-flat", "dense-nested", "dense-betas", "qwen3_5", "qwen3_5_moe"])
def test_float32_logits_equal_mlx_lm(model, tokenizer, tmp_path, kind, theta, yarn):
    """mlx-lm's YarnRoPE (qwen3; qwen3_5 and qwen3_5_moe through qwen3_next's attention, on the
    partial rotary dims), which computes what transformers does for these entries."""
    plain, _, n = model(kind)
    if theta:  # the plain model with the same theta, so that only YaRN differs
        plain = with_yarn(plain, tmp_path / "plain", None, rope_theta=theta)
    folder = with_yarn(plain, tmp_path / "yarn", yarn, max_position_embeddings=LONG)
    ids = prompt_ids(tokenizer, n)
    ref = mlx_lm_logits(folder, ids)
    before = ours_logits(plain, ids)
    ours = ours_logits(folder, ids)
    assert li.YARN == {k: v for k, v in yarn.items() if k != "rope_type"}
    effect, err = rel_err(before, ours), rel_err(ours, ref)
    print(f"YaRN's effect {effect:.2e}, error {err:.2e}")
    assert effect > EFFECT
    assert err < TOL
    assert (mx.argmax(ours, -1) == mx.argmax(ref, -1)).all().item()


def test_cached_decode_equals_full_forward(checkpoint, tokenizer, tmp_path):
    """YaRN in the decode path too: a prefill of 20 tokens, then one token at a time past the
    original 32 positions, equals one full forward (the cache's keys were turned by YaRN's
    frequencies, as the new queries are)."""
    li.load(with_yarn(checkpoint(), tmp_path / "yarn", max_position_embeddings=LONG))
    assert li.YARN
    ids = prompt_ids(tokenizer, 60)
    full = li.forward(ids, [None] * li.N_LAYERS, 0)
    cache = [None] * li.N_LAYERS
    rows = [li.forward(ids[:20], cache, 0)] + [li.forward([ids[p]], cache, p) for p in range(20, 60)]
    assert rel_err(mx.concatenate(rows), full) < 1e-5  # as test_model's cache tests


# ─── The frequencies and the attention factor ───

# (model, rope_theta, rope_scaling): the ramp's bounds as transformers computes them, for
# head_dim 32 (16 pairs) unless Qwen3.5 (partial_rotary_factor 0.25: 8 dims, 4 pairs).
FREQ_CASES = {
    "tiny-original": ("dense", 1e6, YARN),  # the logits tests': low 0 (clamped), high 2
    "interior": ("dense", 1e4, {**YARN, "original_max_position_embeddings": 4096}),  # 5..12
    "truncate-false": ("dense", 1e4, {**YARN, "original_max_position_embeddings": 4096,
                                      "truncate": False}),  # 5.24..11.26: not rounded
    "betas": ("dense", 1e4, {**YARN, "factor": 2.5, "original_max_position_embeddings": 4096,
                             "beta_fast": 16, "beta_slow": 2}),  # 6..11
    "attention-factor": ("dense", 1e4, {**YARN, "original_max_position_embeddings": 4096,
                                        "attention_factor": 1.5}),
    "attention-factor-1": ("dense", 1e4, {**YARN, "original_max_position_embeddings": 4096,
                                          "attention_factor": 1.0}),  # mlx-lm ignores it
    "high-clamped": ("dense", 1e4, {**YARN, "factor": 8, "original_max_position_embeddings":
                                    131072}),  # 11..18: past half - 1 = 15, clamped at dim - 1
    "equal-bounds": ("dense", 1e4, {**YARN, "original_max_position_embeddings": 2}),  # 0..0
    # equal and not whole (11.26): the ramp's divisor 0.001 (a step), not 1, shows
    "equal-bounds-untruncated": ("dense", 1e4, {**YARN, "original_max_position_embeddings": 4096,
                                                "beta_fast": 1, "beta_slow": 1, "truncate": False}),
    "qwen3_5": ("qwen3_5", 1e7, {**YARN, "original_max_position_embeddings": 262144}),  # 1..3
}
MLX_LM_AGREES = [name for name, (_, _, yarn) in FREQ_CASES.items() if "truncate" not in yarn]


def freq_folder(name, checkpoint, qwen35, tmp_path):
    kind, theta, yarn = FREQ_CASES[name]
    if kind == "qwen3_5":
        return with_yarn(qwen35(), tmp_path / "yarn", yarn)  # its own theta, 1e7
    return with_yarn(checkpoint(), tmp_path / "yarn", yarn, rope_theta=theta)


def ours_rope(folder):
    """After load_checked(folder): (li.yarn's frequencies and scale, from the plain frequencies as
    rope_tables() computes them), and the same read back from rope_tables() at position 1:
    cos = scale cos(f), sin = scale sin(f) (f < pi: the angle is f itself)."""
    li.load_checked(folder)
    dims = int(li.D_HEAD * li.QWEN35.get("partial_rotary_factor", 1))
    half = dims // 2
    plain = 1.0 / li.THETA ** (mx.arange(half, dtype=mx.float32) / half)
    freqs, scale = li.yarn(plain)
    cos, signed_sin = li.rope_tables(mx.array([1]), mx.float32, dims)  # (1, 1, 2, half) each
    c, s = np.array(cos[0, 0, 0]), np.array(signed_sin[0, 0, 1])
    assert np.allclose(np.array(cos[0, 0, 1]), c) and np.allclose(np.array(signed_sin[0, 0, 0]), -s)
    return np.array(freqs), scale, np.arctan2(s, c), np.hypot(s, c)


def check_rope(folder, ref_freqs, ref_scale):
    """float32 frequencies (base ** (i / half) and the blend, in float32 on both sides): a few
    ulps, measured 1e-7 relative; a ramp bound off by one or a wrong blend moves some by a
    percent or more. The scale: both compute it in Python floats."""
    freqs, scale, table_freqs, table_scale = ours_rope(folder)
    assert freqs.shape == ref_freqs.shape
    assert np.abs(freqs / ref_freqs - 1).max() < 1e-5
    assert scale == pytest.approx(ref_scale, rel=1e-9)
    assert np.abs(table_freqs / ref_freqs - 1).max() < 1e-5  # what the model turns by
    assert np.abs(table_scale / ref_scale - 1).max() < 1e-5


@pytest.mark.parametrize("name", list(FREQ_CASES))
def test_yarn_equals_transformers(checkpoint, qwen35, tmp_path, name):
    """li.yarn() against transformers' _compute_yarn_parameters on the same config.json: truncate
    false, beta_fast/beta_slow and attention_factor as given, high bound clamped, equal bounds."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    folder = freq_folder(name, checkpoint, qwen35, tmp_path)
    config = transformers.AutoConfig.from_pretrained(folder).get_text_config()
    inv_freq, attention_factor = _compute_yarn_parameters(config)
    check_rope(folder, inv_freq.numpy(), attention_factor)


@pytest.mark.parametrize("name", MLX_LM_AGREES)
def test_yarn_equals_mlx_lm(checkpoint, qwen35, tmp_path, name):
    """Without torch: mlx-lm's YarnRoPE, where it computes what transformers does: no truncate
    (mlx-lm always rounds the bounds). It ignores attention_factor: given, the scale is that
    entry (its frequencies are unchanged by it). Its _freqs are periods (1 / f)."""
    kind, _, yarn = FREQ_CASES[name]
    folder = freq_folder(name, checkpoint, qwen35, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    theta = cfg["rope_parameters"]["rope_theta"] if "rope_parameters" in cfg else cfg["rope_theta"]
    dims = int(cfg["head_dim"] * cfg.get("rope_parameters", {}).get("partial_rotary_factor", 1))
    rope = initialize_rope(dims, theta, False, yarn, cfg["max_position_embeddings"])
    assert type(rope).__name__ == "YarnRoPE"
    check_rope(folder, 1.0 / np.array(rope._freqs), yarn.get("attention_factor", rope.mscale))


# ─── 3. The context it reaches, and the summary line ───

def test_context_is_factor_times_original(checkpoint, tmp_path, tokenizer):
    """max_position_embeddings 64, factor 4 over 32: 128 positions (the larger of the two), and
    a prompt of 93 tokens, past 64, runs; the summary line says so."""
    folder = with_yarn(checkpoint(), tmp_path / "yarn", {**YARN, "factor": 4},
                       max_position_embeddings=64)
    li.load_checked(folder)
    assert li.MAX_POS == 128 and li.YARN["factor"] == 4
    li.load_checked(with_yarn(checkpoint(), tmp_path / "longer", max_position_embeddings=2048))
    assert li.MAX_POS == 2048  # max_position_embeddings already past factor x original
    prompt = TEXT * 3
    assert 64 < len(tokenizer.encode(prompt).ids) < 128 - 3
    r = run_cli("--model", str(folder), "--prompt", prompt, "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert "RoPE by YaRN x4 to 128 positions" in r.stdout.splitlines()[0]
    assert "context limit" not in r.stderr  # 93 + 3 tokens fit in 128


# ─── 4. Refusals: one line, naming config.json and the entry ───

@pytest.mark.parametrize("scaling, needles", [
    ({"rope_type": "yarn", "factor": 4.0}, ["original_max_position_embeddings"]),
    ({"rope_type": "yarn", "original_max_position_embeddings": 32}, ["'factor'"]),
    ({**YARN, "mscale": 0.707}, ["mscale", "0.707"]),
    ({**YARN, "mscale_all_dim": 1.0}, ["mscale_all_dim"]),
    ({"rope_type": "linear", "factor": 4.0}, ['"linear"']),
    ({"type": "dynamic", "factor": 4.0}, ['"dynamic"']),
    ({**YARN, "factor": "4"}, ["factor", '"4"']),
    ({**YARN, "factor": 0}, ["factor", "a number more than 0"]),
    ({**YARN, "original_max_position_embeddings": 32.5}, ["original_max_position_embeddings",
                                                          "32.5"]),
    ({**YARN, "truncate": "no"}, ["truncate", "true or false"]),
], ids=["no-original", "no-factor", "mscale", "mscale_all_dim", "linear", "dynamic",
        "factor-string", "factor-zero", "original-fraction", "truncate-string"])
def test_refused_in_one_line(checkpoint, tmp_path, scaling, needles):
    folder = with_yarn(checkpoint(), tmp_path / "yarn", scaling)
    assert_error(run_cli("--model", str(folder), "--max-tokens", "1"), "config.json", "rope_scaling",
                 *needles)


def test_qwen35_nested_refused_in_one_line(qwen35, tmp_path):
    """Qwen3.5's entry in text_config.rope_parameters is checked as rope_scaling is, and named."""
    folder = with_yarn(qwen35(), tmp_path / "yarn", {"rope_type": "yarn", "factor": 4.0})
    assert_error(run_cli("--model", str(folder), "--max-tokens", "1"), "config.json",
                 "rope_parameters has no 'original_max_position_embeddings' entry")


# ─── 5. Part I's load() does not ignore it ───

@pytest.mark.parametrize("form", ["rope_scaling", "rope_parameters", "rope_parameters-type"])
def test_load_applies_yarn(checkpoint, tmp_path, form):
    """li.load() (Part I's, unchecked) on a dense Qwen3 with YaRN hands over to load_checked():
    flat rope_scaling; transformers 5's rope_parameters with rope_type; rope_parameters with the
    older key "type", which transformers reads as rope_type."""
    yarn = YARN if form != "rope_parameters-type" else \
        {"type": "yarn", **{k: v for k, v in YARN.items() if k != "rope_type"}}
    plain = checkpoint(rope="flat" if form == "rope_scaling" else "nested")
    folder = with_yarn(plain, tmp_path / "yarn", yarn, max_position_embeddings=64)
    if form == "rope_parameters-type":  # "type" alone ("rope_type": "default" would win)
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["rope_parameters"]["rope_type"]
        (folder / "config.json").write_text(json.dumps(cfg))
    li.load(folder)
    assert li.YARN == {"factor": 4.0, "original_max_position_embeddings": 32}
    assert li.MAX_POS == 128
    li.load(plain)
    assert li.YARN == {}  # a plain folder after a YaRN one: nothing left over


# ─── 6. A scaling entry that names no kind: the plain RoPE, as transformers and mlx-lm read it
# transformers 5.25 (modeling_rope_utils.py): convert_rope_params_to_dict() takes
# `rope_scaling or rope_parameters`, so {} is dropped; standardize_rope_params() then sets
# rope_type to rope_parameters.get("type", "default"), and validate_rope() checks the entry as a
# "default" one: "factor" and the like are only warned about ("Unrecognized keys in
# `rope_parameters` for 'rope_type'='default'"), and the model computes the plain RoPE
# (Qwen3RotaryEmbedding.compute_default_rope_parameters: rope_theta and head_dim alone).
# mlx-lm's initialize_rope(): no "type" or "rope_type" -> "default" -> nn.RoPE, factor unread.

UNTYPED = {  # (the plain folder, the entry, its value without a kind)
    "rope_scaling-empty": ("flat", "rope_scaling", {}),
    "rope_scaling-factor": ("flat", "rope_scaling", {"factor": 4.0}),
    "rope_scaling-factor-original": ("flat", "rope_scaling",
                                     {"factor": 4.0, "original_max_position_embeddings": 32}),
    "rope_parameters-theta": ("nested", "rope_parameters", {"rope_theta": 1000000.0}),
    "rope_parameters-factor": ("nested", "rope_parameters", {"rope_theta": 1000000.0,
                                                             "factor": 4.0}),
    "qwen3_5-rope_parameters": ("qwen3_5", "rope_parameters", None),  # its own, rope_type removed
}


def untyped_folder(name, checkpoint, qwen35, tmp_path):
    """-> (the plain folder, a copy whose config.json has UNTYPED[name]'s entry)."""
    kind, entry, value = UNTYPED[name]
    plain = qwen35() if kind == "qwen3_5" else checkpoint(rope=kind)
    folder = Path(shutil.copytree(plain, tmp_path / "untyped"))
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    if value is None:  # Qwen3.5's rope_parameters (partial_rotary_factor, mrope_section) untyped
        value = {k: v for k, v in text[entry].items() if k not in ("rope_type", "type")}
    text[entry] = value
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return plain, folder


@pytest.mark.parametrize("name", list(UNTYPED))
def test_a_scaling_entry_without_a_kind_is_the_plain_rope(checkpoint, qwen35, tokenizer, tmp_path,
                                                           name):
    """load_checked() runs it, with the folder's own context (no YaRN, max_position_embeddings
    as given), and computes what the same folder without the entry computes: the same logits
    (the same weights through the same code and tables: equal, not merely close) and the same
    greedy tokens; mlx-lm, which reads it as the plain RoPE too, agrees within TOL. Prompts run
    past 32 positions, so that a factor applied (as YaRN's or linear scaling) would show."""
    plain, folder = untyped_folder(name, checkpoint, qwen35, tmp_path)
    ids = prompt_ids(tokenizer, 60)
    li.load_checked(plain)
    ref, ref_tokens = li.forward(ids, [None] * li.N_LAYERS, 0), list(li.generate(ids, 8))
    li.load_checked(folder)
    assert li.YARN == {} and li.MAX_POS == 2048
    ours = li.forward(ids, [None] * li.N_LAYERS, 0)
    assert mx.array_equal(ours, ref), rel_err(ours, ref)
    assert list(li.generate(ids, 8)) == ref_tokens
    assert rel_err(ours, mlx_lm_logits(folder, ids)) < TOL
    li.load(folder)  # Part I's load(): the same (it hands over to load_checked() or reads it)
    assert li.YARN == {} and mx.array_equal(li.forward(ids, [None] * li.N_LAYERS, 0), ref)


def test_an_empty_rope_scaling_runs_from_the_command_line(checkpoint, tmp_path):
    """The command line's view: "rope_scaling": {} is no scaling; the text is the plain
    folder's, and the model's line says no YaRN."""
    plain, folder = untyped_folder("rope_scaling-empty", checkpoint, None, tmp_path)
    r, one = (run_cli("--model", str(f), "-m", "5") for f in (folder, plain))
    assert r.returncode == 0, r.stderr
    assert "YaRN" not in r.stdout and r.stdout.split("==========")[1] == one.stdout.split(
        "==========")[1]
