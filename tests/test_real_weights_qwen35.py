"""On a real Qwen3.5 checkpoint: our numbers are mlx-lm's, our chat prompt is the checkpoint's own.

    QWEN35_WEIGHTS=/path/to/folder python -m pytest tests/test_real_weights_qwen35.py

The folder is the one named by QWEN35_WEIGHTS, else Qwen/Qwen3.5-0.8B in the Hugging Face cache
once whole (`python llm_inference.py --model Qwen/Qwen3.5-0.8B` puts it there). Without one,
every test here skips and says how to enable them.
"""
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

import llm_inference as li
from test_model import (assert_generate_agrees, greedy_along_mlx_lm, mlx_lm_greedy, mlx_lm_logits,
                        rel_err)


def folder():
    if os.environ.get("QWEN35_WEIGHTS"):
        return Path(os.environ["QWEN35_WEIGHTS"])
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download("Qwen/Qwen3.5-0.8B", local_files_only=True))
    except Exception:  # not in the cache
        return Path("Qwen3.5-0.8B (not in the Hugging Face cache)")


FOLDER = folder()
COMPLETE = all((FOLDER / f).is_file() for f in ["config.json", "tokenizer.json"]) and \
    any(FOLDER.glob("*.safetensors"))
pytestmark = pytest.mark.skipif(not COMPLETE, reason=(
    f"no complete Qwen3.5 checkpoint in {FOLDER}: run `python llm_inference.py --model "
    "Qwen/Qwen3.5-0.8B` once, or set QWEN35_WEIGHTS to a folder that holds one"))
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def ids():
    li.load(FOLDER)
    return li.TOK.encode(PROMPT).ids


def test_logits_as_accurate_as_mlx_lm(ids):
    """bfloat16, as released: ours no further from the exact answer (mlx-lm's, the same weights
    in float32) than twice mlx-lm's own bfloat16 error; the same likeliest token."""
    ours, ref = li.forward(ids, [None] * li.N_LAYERS, 0), mlx_lm_logits(FOLDER, ids)
    exact = mlx_lm_logits(FOLDER, ids, dtype=mx.float32)
    err_ours, err_ref = rel_err(ours, exact), rel_err(ref, exact)
    print(f"{ours.dtype} error vs float32: ours {err_ours:.2e}, mlx-lm {err_ref:.2e}")
    assert err_ours <= 2 * err_ref
    assert mx.argmax(ours[-1]).item() == mx.argmax(ref[-1]).item()


def test_greedy_ids_equal_mlx_lm(ids):
    """20 greedy steps in float32 (test_real_weights.py says why), teacher-forced."""
    ref_ids, top2s, ref_logits = mlx_lm_greedy(FOLDER, ids, 20, mx.float32)
    try:
        li.load(FOLDER, mx.float32)
        assert rel_err(li.prefill(ids, [None] * li.N_LAYERS), ref_logits) < 1e-4
        agreed = greedy_along_mlx_lm(ids, ref_ids, top2s, ref_logits)
        assert_generate_agrees(ids, 20, ref_ids, agreed)
    finally:
        li.load(FOLDER)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is the capital of France? 🇫🇷"}],
    [{"role": "system", "content": "You are terse. "}, {"role": "user", "content": " 日本の首都は?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"},
     {"role": "user", "content": "And Japan?"}],
])
@pytest.mark.parametrize("think", [True, False])
def test_chat_prompt_equals_the_checkpoint_template(ids, messages, think):
    template_ids = load_tokenizer(FOLDER).apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=think)
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    turns = [m["content"] for m in messages if m["role"] != "system"]
    assert li.TOK.encode(li.chat_prompt(turns, system, think)).ids == list(template_ids)
