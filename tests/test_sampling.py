"""sample(), streaming text and the command line."""
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import llm_inference as li

ROOT = Path(__file__).resolve().parent.parent
LOGITS = mx.log(mx.array([0.05, 0.5, 0.02, 0.3, 0.1, 0.03]))  # probabilities, shuffled


def draws(n, **kw):
    return np.array([li.sample(LOGITS, **kw).item() for _ in range(n)])


def test_temperature_zero_is_argmax():
    rng = np.random.default_rng(1)
    for _ in range(20):
        logits = mx.array(rng.normal(size=1000).astype(np.float32))
        assert li.sample(logits, temperature=0.0).item() == int(np.argmax(np.array(logits)))


def test_small_top_p_keeps_only_the_nucleus():
    mx.random.seed(0)
    # sorted: 0.5 (id 1), 0.3 (id 3), 0.1 (id 4) ... top_p 0.7: mass before id 3 is 0.5 < 0.7,
    # before id 4 it is 0.8 >= 0.7, so the nucleus is {1, 3}.
    assert set(draws(400, temperature=1.0, top_p=0.7)) == {1, 3}
    assert set(draws(200, temperature=1.0, top_p=0.4)) == {1}  # the top token alone
    assert set(draws(400, temperature=1.0, top_p=1.0)) == {0, 1, 2, 3, 4, 5}


def test_top_k_and_min_p_cut_the_tail():
    """Sorted: 0.5 (id 1), 0.3 (id 3), 0.1 (id 4), 0.05 (id 0) ... top_k 2 keeps ids 1 and 3;
    min_p 0.15 keeps those at least 0.15 x 0.5 = 0.075 likely: 1, 3 and 4; with top_p too, both."""
    mx.random.seed(5)
    assert set(draws(400, temperature=1.0, top_k=2)) == {1, 3}
    assert set(draws(600, temperature=1.0, min_p=0.15)) == {1, 3, 4}
    assert set(draws(400, temperature=1.0, top_k=3, top_p=0.7)) == {1, 3}


def test_each_row_draws_its_own():
    """Rows of equal logits, sampled at once: each row its own draw (one shared draw would give
    every row the same id), each from the distribution a single row has."""
    mx.random.seed(11)
    rows = li.sample(mx.broadcast_to(LOGITS, (64, 6)), temperature=1.0)     # (64,)
    assert rows.shape == (64,) and len(set(rows.tolist())) > 2
    assert set(rows.tolist()) <= {0, 1, 2, 3, 4, 5}


def test_frequencies_match_renormalised_nucleus():
    mx.random.seed(1234)
    n = 4000
    counts = np.bincount(draws(n, temperature=1.0, top_p=0.85), minlength=6)
    nucleus = np.array([0, 0.5, 0, 0.3, 0.1, 0]) / 0.9  # {1, 3, 4}: mass before id 4 is 0.8 < 0.85
    std = np.sqrt(n * nucleus * (1 - nucleus))
    assert np.all(np.abs(counts - n * nucleus) <= 4 * std + 1e-9), counts


def test_temperature_sharpens_and_flattens():
    mx.random.seed(7)
    n = 3000
    for t in (0.5, 2.0):
        p = np.array([0.05, 0.5, 0.02, 0.3, 0.1, 0.03]) ** (1 / t)
        p /= p.sum()
        counts = np.bincount(draws(n, temperature=t), minlength=6)
        assert np.all(np.abs(counts - n * p) <= 4 * np.sqrt(n * p * (1 - p)) + 1), (t, counts)


def test_same_seed_same_text(checkpoint, tokenizer):
    li.load(checkpoint())
    ids = tokenizer.encode("Once upon a time").ids
    runs = []
    for seed in (3, 3, 4):
        mx.random.seed(seed)
        sampler = partial(li.sample, temperature=1.0, top_p=0.9)
        runs.append(list(li.generate(ids, max_tokens=16, sampler=sampler)))
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize("text", ["The capital of France is Paris.", "日本の首都は東京です。中国的首都是北京。",
                                  "Emoji ❤️ 👍🏽 🇫🇷 😀 done", "mixed: naïve café ☕️ 한국어"])
def test_streamed_pieces_equal_decode(checkpoint, tokenizer, text):
    li.load(checkpoint())
    ids = tokenizer.encode(text).ids
    pieces = [piece for _, piece in li.stream_text(ids)]
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)  # never a broken character on screen
    if "❤️" in text:  # the test is meaningful: some token alone is half a character
        assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


def run_cli(*args):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, str(ROOT / "llm_inference.py"), *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_cli_end_to_end(checkpoint, tokenizer):
    folder = checkpoint()
    li.load(folder)
    prompt = "The capital of France is"
    generated = list(li.generate(tokenizer.encode(prompt).ids, max_tokens=12))
    # Random weights emit stray bytes: the screen shows what stream_text makes of them (tested
    # against tokenizer.decode above for real text).
    expected = "".join(piece for _, piece in li.stream_text(generated))
    assert len(expected) >= 3
    r = run_cli("--model", str(folder), "--prompt", prompt, "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "3 layers, hidden 64, 4 query / 2 KV heads x 32" in r.stdout
    assert prompt + expected + "\n==========" in r.stdout
    assert f"Prompt: {len(tokenizer.encode(prompt).ids)} tokens, " in r.stdout
    assert "Generation: 12 tokens, " in r.stdout and "tokens-per-sec" in r.stdout
    assert "Peak memory: " in r.stdout and " GB" in r.stdout


def test_cli_sampling_flags_and_seed(checkpoint):
    folder = str(checkpoint())
    args = ("--model", folder, "--prompt", "Once", "-m", "10", "--temp", "0.9", "--top-p", "0.95")
    a, b = run_cli(*args, "--seed", "5"), run_cli(*args, "--seed", "5")
    assert a.returncode == 0 and a.stdout.split("==========")[1] == b.stdout.split("==========")[1]


def test_cli_dtype_flag(checkpoint):
    folder = str(checkpoint(dtype="bfloat16"))
    r = run_cli("--model", folder, "--prompt", "Once", "-m", "4", "--dtype", "float32")
    assert r.returncode == 0 and "float32" in r.stdout.splitlines()[0]
    assert "bfloat16" in run_cli("--model", folder, "--prompt", "Once", "-m", "4").stdout.splitlines()[0]


def test_temperature_comes_before_top_p():
    """p = [0.5, 0.3, 0.2], temperature 2, top-p 0.45. Temperature first (the article, transformers):
    p becomes [0.41, 0.32, 0.26], and the nucleus is the first two. Top-p first would keep one."""
    mx.random.seed(3)
    logits = mx.log(mx.array([0.5, 0.3, 0.2]))
    seen = {li.sample(logits, temperature=2.0, top_p=0.45).item() for _ in range(300)}
    assert seen == {0, 1}


def test_top_p_equal_to_a_cumulative_mass_keeps_the_smallest_set_that_reaches_it():
    """p = [0.5, 0.25, 0.25] and top-p exactly the first probability (as sample() computes it):
    one token reaches it, so one is kept (`<=` in place of `<` would keep two)."""
    mx.random.seed(4)
    logits = mx.log(mx.array([0.5, 0.25, 0.25]))
    first = mx.softmax(logits.astype(mx.float32) / 1.0)[0].item()
    assert {li.sample(logits, temperature=1.0, top_p=first).item() for _ in range(200)} == {0}
    assert {li.sample(logits, temperature=1.0, top_p=first + 1e-6).item() for _ in range(300)} == {0, 1}


def test_top_p_one_cuts_no_tail_of_a_peaked_distribution(monkeypatch):
    """Qwen3's 151,936 logits, one 30 above the rest: the others' probabilities are tiny but not 0
    (about 9e-14 each), and the top one's, 1 - 1.4e-8, is 1.0 in float32, so the mass before
    each other token is 1.0. top_p=1.0 (no cut: mlx-lm's default) must leave every token drawable: the logits
    that reach mx.random.categorical hold no -inf."""
    vocab = 151936
    logits = mx.zeros(vocab).at[1234].add(30.0)
    probs = mx.softmax(logits)
    assert (probs > 0).all().item()  # every token can be drawn
    ordered = mx.sort(probs)[::-1]
    assert mx.cumsum(ordered, inclusive=False)[1].item() >= 1.0  # float32's mass is 1.0 at once
    seen, categorical = [], mx.random.categorical

    def capture(masked, *args, **kwargs):
        seen.append(masked)
        return categorical(masked, *args, **kwargs)
    monkeypatch.setattr(mx.random, "categorical", capture)
    li.sample(logits, temperature=1.0, top_p=1.0).item()
    assert len(seen) == 1 and seen[0].shape[-1] == vocab
    cut = (seen[0] == -mx.inf).sum().item()
    assert cut == 0, f"top_p=1.0 cut {cut} of {vocab} tokens"


def test_top_k_flag_reaches_the_sampler(checkpoint):
    """--temperature 5 --top-k 1: the likeliest token alone, so the greedy text, whatever the
    seed; --temperature 5 alone, with the same seed, writes another."""
    args = ("--model", str(checkpoint()), "--prompt", "Once upon a time", "-m", "12", "--seed", "3")
    text = lambda *extra: run_cli(*args, *extra).stdout.split("==========")[1]  # noqa: E731
    greedy = text()
    assert text("--temperature", "5", "--top-k", "1") == greedy
    assert text("--temperature", "5") != greedy
