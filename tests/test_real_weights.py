"""On a real Qwen3 checkpoint: our numbers are mlx-lm's, our chat prompt is the checkpoint's own.

    python -m pytest tests/test_real_weights.py                       # Qwen3-0.6B/, once downloaded
    QWEN3_WEIGHTS=/path/to/folder python -m pytest tests/test_real_weights.py

The folder is the one named by QWEN3_WEIGHTS, else the default Qwen3-0.6B/ once it holds every
file the first run downloads. Without one, every test here skips and says how to enable them.
Everything runs in the checkpoint's own dtype (bfloat16 for the released weights).
"""
import hashlib
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

import llm_inference as li
from test_model import (assert_generate_agrees, greedy_along_mlx_lm, mlx_lm_greedy, mlx_lm_logits,
                        rel_err)

FOLDER = Path(os.environ.get("QWEN3_WEIGHTS") or li.HERE / "Qwen3-0.6B")
NEEDED = ["config.json", "tokenizer.json", "tokenizer_config.json"]
COMPLETE = all((FOLDER / f).is_file() for f in NEEDED) and any(FOLDER.glob("*.safetensors"))
pytestmark = pytest.mark.skipif(not COMPLETE, reason=(
    f"no complete Qwen3 checkpoint in {FOLDER}: run `python llm_inference.py` once (it downloads "
    "Qwen3-0.6B), or set QWEN3_WEIGHTS to a folder with config.json, tokenizer.json, "
    "tokenizer_config.json and the *.safetensors"))
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def ids():
    """Loads the checkpoint once for the module (1.5 GB); a test that loads it in another dtype
    loads it back."""
    li.load(FOLDER)
    return li.TOK.encode(PROMPT).ids


@pytest.fixture(scope="module")
def prompt_logits(ids):
    """Ours and mlx-lm's logits for the prompt, (L, vocab) each."""
    return li.forward(ids, [None] * li.N_LAYERS, 0), mlx_lm_logits(FOLDER, ids)


def test_logits_equal_mlx_lm(prompt_logits, ids):
    """The tolerance of the random-weight tests (test_model.py): in float32 a relative error
    under 1e-4; in bfloat16, ours no further from the exact answer (the same weights run in
    float32 by mlx-lm) than twice mlx-lm's own bfloat16 error, and the same likeliest tokens."""
    ours, ref = prompt_logits
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ours.dtype == mx.float32:
        print(f"float32: ours vs mlx-lm {rel_err(ours, ref):.2e}")
        assert rel_err(ours, ref) < 1e-4
    else:
        exact = mlx_lm_logits(FOLDER, ids, dtype=mx.float32)
        err_ours, err_ref = rel_err(ours, exact), rel_err(ref, exact)
        print(f"{ours.dtype} error vs float32: ours {err_ours:.2e}, mlx-lm {err_ref:.2e}; "
              f"ours vs mlx-lm {rel_err(ours, ref):.2e}")
        assert err_ours <= 2 * err_ref
    assert mx.argmax(ours[-1]).item() == mx.argmax(ref[-1]).item()


def test_greedy_ids_equal_mlx_lm(ids):
    """20 greedy steps, proven in float32: both models run the checkpoint's weights in float32
    (bfloat16 -> float32 is exact), teacher-forced along mlx-lm's ids (test_model.py's
    greedy_along_mlx_lm), so our argmax must be mlx-lm's at every step whose two likeliest logits
    are further apart than float32's resolution plus how far our logits are from mlx-lm's.

    Why not bfloat16: two correct bfloat16 implementations round at different places, so their
    logits differ by up to ~0.1-1 where a trained model's top two can be closer than that; there
    the proof could only call the step a tie, and on some honest checkpoints most steps are ties.
    In float32 the two agree to about 1e-5 relative and a tie essentially never happens, so every
    step is compared, and the logits themselves must agree within float32's bound (1e-4 relative,
    as on the tiny checkpoints): that is what catches a subtle break such as rms_norm's eps
    outside the square root. bfloat16 itself is proven by test_logits_equal_mlx_lm's bound. One
    model is in memory at a time (an 8 GB Mac holds one 0.6B model in float32, 2.4 GB)."""
    ref_ids, top2s, ref_logits = mlx_lm_greedy(FOLDER, ids, 20, mx.float32)
    try:
        li.load(FOLDER, mx.float32)
        ours = li.prefill(ids, [None] * li.N_LAYERS)                   # the prompt's last logits
        print(f"float32: ours vs mlx-lm {rel_err(ours, ref_logits):.2e}")
        assert rel_err(ours, ref_logits) < 1e-4  # as test_model.py's float32 bound
        agreed = greedy_along_mlx_lm(ids, ref_ids, top2s, ref_logits)
        assert_generate_agrees(ids, 20, ref_ids, agreed)
    finally:
        li.load(FOLDER)


@pytest.mark.parametrize("messages, think", [
    ([{"role": "user", "content": "What is the capital of France? 🇫🇷"}], False),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "日本の首都は?"}], False),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"},
      {"role": "user", "content": "And Japan?"}], True),
])
def test_chat_prompt_equals_the_checkpoint_template(ids, messages, think):
    """chat_prompt() writes Qwen3's template out by hand; the checkpoint's tokenizer_config.json
    carries the template itself, which mlx-lm's tokenizer renders (with enable_thinking)."""
    template_ids = load_tokenizer(FOLDER).apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=think)
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    turns = [m["content"] for m in messages if m["role"] != "system"]
    assert li.TOK.encode(li.chat_prompt(turns, system, think)).ids == list(template_ids)


def released_qwen3_06b(folder):
    """Is this Qwen/Qwen3-0.6B's release? Told by files, not by what the weights compute:
    config.json has its shapes, model.safetensors is about 1.5 GB of bfloat16, and
    huggingface_hub's download record beside it (.cache/huggingface/download/*.metadata, left
    by the first run or `hf download --local-dir`) names a content hash (its second line, the
    file's SHA-256) that the file still has: it is exactly what the Hub served."""
    cfg, weights = li.parse_json(folder / "config.json"), folder / "model.safetensors"
    record = folder / ".cache" / "huggingface" / "download" / "model.safetensors.metadata"
    shapes = (cfg.get("num_hidden_layers"), cfg.get("hidden_size"), cfg.get("vocab_size"))
    if shapes != (28, 1024, 151936) or not weights.is_file() or not record.is_file():
        return False
    if not 1.4e9 < weights.stat().st_size < 1.6e9:
        return False
    sha256 = hashlib.sha256()
    with open(weights, "rb") as f:
        while chunk := f.read(1 << 24):
            sha256.update(chunk)
    return record.read_text().splitlines()[1].strip() == sha256.hexdigest()


def test_paris_with_the_articles_probability(ids):
    """The article's demo: after "The capital of France is", the likeliest next token is " Paris"
    with probability 0.6582. Only the released weights can give it, so only they are asked.

    The article's script computes RoPE's cos/sin in float32, which promotes q, k, the attention
    output and from there the whole residual stream to float32: its 0.6582 is (nearly) a float32
    run on the bfloat16 weights. It differs from ours in float32 (load(..., mx.float32): the same
    weights, exactly) only where its first block still rounds to bfloat16 before the promotion
    (the norm and the q, k, v projections) and in summation order.
    Our own bfloat16 run rounds in all 28 blocks: bfloat16 keeps 8 significant bits, so a logit
    near 20 is known to about +-0.08, which moves p = 0.66 by up to p (1 - p) x 0.08 = 0.018:
    tolerance 0.02. In float32 only the article's first block rounds: one block's share of
    independent roundings, +-0.08 / sqrt(28) = +-0.015 on a logit, on the top one and the rest
    in opposite directions at worst, moves p by up to 2 p (1 - p) x 0.015 = 0.007: tolerance
    0.01. Both are checked: the first proves the arithmetic, the second what the script prints."""
    if not released_qwen3_06b(FOLDER):
        pytest.skip(f"{FOLDER} is not recognisably Qwen/Qwen3-0.6B's release as downloaded "
                    "from the Hub (config shapes, size, huggingface_hub's download record)")
    (_, text, p), *_ = li.top_tokens(li.prefill(ids, [None] * li.N_LAYERS), 5)  # --show-probs
    assert text == " Paris"
    assert p == pytest.approx(0.6582, abs=0.02)
    try:
        li.load(FOLDER, mx.float32)
        (_, text, p), *_ = li.top_tokens(li.prefill(ids, [None] * li.N_LAYERS), 5)
        assert text == " Paris"
        assert p == pytest.approx(0.6582, abs=0.01)
    finally:
        li.load(FOLDER)
