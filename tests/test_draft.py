"""Multi-token prediction (Part II, generate_draft()): drafts from Qwen3.5's MTP head or from
prompt lookup, checked by the model in one pass. Proven exact in float32: the ids equal
generate()'s, token for token, across accepted and rejected drafts; sampling keeps the model's
distribution."""
import shutil
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import llm_inference as li
from test_cli_errors import assert_error, run_cli

TEXTS = ["The capital of France is", "a", "Once upon a time there was a small model that",
         "The capital of France is Paris. The capital of Japan is Tokyo. The capital of France is"]
HEADS = [dict(mtp="random"), dict(mtp="agree", layers_scale=2.0), dict(mtp="agree", layers_scale=0.0)]


def drafted(ids, n, **options):
    counts = {}
    return list(li.generate_draft(ids, max_tokens=n, counts=counts, **options)), counts


@pytest.mark.parametrize("head", HEADS, ids=["random", "in-between", "agreeing"])
def test_mtp_drafts_give_generates_ids(qwen35, head):
    """A random head (its drafts mostly rejected), one built to agree with the model (accepted),
    one in between: the same ids as generate(), on a model whose DeltaNet layers matter."""
    li.load(qwen35(**head))
    total = {"drafted": 0, "accepted": 0}
    for text in TEXTS:
        ids = li.tokenize(text)
        ours, counts = drafted(ids, 24, draft="mtp")
        assert ours == list(li.generate(ids, max_tokens=24))
        total = {k: total[k] + counts[k] for k in total}
    share = total["accepted"] / total["drafted"]
    assert {"random": share < 0.2, "in-between": 0.1 < share < 0.9,
            "agreeing": share > 0.9}[head.get("mtp") if head["mtp"] == "random" else
                                     "agreeing" if head["layers_scale"] == 0 else "in-between"]


def test_the_agreeing_head_drafts_the_models_next_token(qwen35):
    """Built so that, with the model's layers adding nothing, its draft for x_t+2 is the model's
    own choice after x_t+1: every draft stands. (Had the head read [h, embedding] instead of
    [embedding, h], or skipped a norm, they would not.)"""
    li.load(qwen35(mtp="agree", layers_scale=0.0, tied=False))  # untied: no id maps to itself
    ids = li.tokenize(TEXTS[2])
    ours, counts = drafted(ids, 30, draft="mtp")
    assert ours == list(li.generate(ids, max_tokens=30)) and len(set(ours)) > 5
    assert counts["accepted"] == counts["drafted"] > 10


@pytest.mark.parametrize("model", ["qwen3", "qwen35"])
@pytest.mark.parametrize("k", [1, 3])
def test_prompt_lookup_gives_generates_ids(checkpoint, qwen35, model, k):
    li.load(checkpoint() if model == "qwen3" else qwen35(mtp="none"))
    for text in TEXTS + ["a a a a a a a a", "1 2 3 1 2 3 1 2 3 1 2"]:
        ids = li.tokenize(text)
        assert drafted(ids, 20, draft="lookup", n_draft=k)[0] == list(li.generate(ids, max_tokens=20))


def test_lookup_drafts_what_followed_before():
    history = [5, 6, 7, 8, 9, 5, 6, 7]
    assert li.lookup_draft(history, 2) == [8, 9] and li.lookup_draft(history, 5) == [8, 9, 5, 6, 7]
    assert li.lookup_draft([1, 2, 3], 2) == [] and li.lookup_draft([4, 4], 3) == [4]


def test_a_chunked_prompt_and_the_contexts_end(qwen35, monkeypatch):
    """A prompt longer than a chunk (CHUNK made 4 here), and a context that ends mid-draft."""
    monkeypatch.setattr(li, "CHUNK", 4)
    li.load(qwen35(mtp="agree", layers_scale=2.0, max_position_embeddings=40))
    ids = li.tokenize(TEXTS[2])
    for draft in ("mtp", "lookup"):
        ours = drafted(ids, 100, draft=draft)[0]
        assert ours == list(li.generate(ids, max_tokens=100)) and len(ours) == 40 - len(ids)


def test_eos_inside_an_accepted_draft(qwen35, monkeypatch):
    """Each id that the model chooses first at its position made an EOS id in turn (with ~40% of
    drafts accepted, some of them sit where a draft stood): the ids stop before it, as generate()'s
    do, and the cache (its DeltaNet states rolled back) holds exactly what was yielded."""
    li.load(qwen35(mtp="agree", layers_scale=2.0))
    ids = li.tokenize(TEXTS[2])
    free, eos = list(li.generate(ids, max_tokens=20)), li.EOS_IDS
    after = li.tokenize(" more")
    for j in [j for j in range(1, 20) if free[j] not in free[:j]]:
        monkeypatch.setattr(li, "EOS_IDS", eos | {free[j]})
        cache = [None] * li.N_LAYERS
        assert list(li.generate_draft(ids, max_tokens=20, draft="mtp", cache=cache)) == free[:j]
        continued = list(li.generate(after, max_tokens=4, cache=cache, start=len(ids) + j))
        assert continued == list(li.generate(ids + free[:j] + after, max_tokens=4))


@pytest.mark.parametrize("draft", ["mtp", "lookup"])
def test_the_cache_holds_what_was_yielded(qwen35, draft):
    """Rejected drafts leave nothing behind: continuing from the cache equals a fresh run on the
    prompt and the ids yielded (a chat turn's next prompt continues a cache this way)."""
    li.load(qwen35(mtp="agree", layers_scale=2.0))
    ids = li.tokenize(TEXTS[3])
    cache = [None] * li.N_LAYERS
    ours = list(li.generate_draft(ids, max_tokens=15, draft=draft, cache=cache))
    after = li.tokenize(" Next")
    assert list(li.generate_draft(after, max_tokens=8, draft=draft, cache=cache,
                                  start=len(ids) + 15)) == \
        list(li.generate(ids + ours + after, max_tokens=8))


def test_sampling_keeps_the_models_distribution(qwen35):
    """At temperature 1 the second id, drawn 400 times with drafting, against the model's own
    probabilities given each first id: the total variation between the counts and their
    expectation is within what 400 draws allow (a draft that biased the choice would exceed it)."""
    li.load(qwen35(mtp="agree", layers_scale=2.0))
    ids = li.tokenize(TEXTS[0])
    mx.random.seed(0)
    draws = [drafted(ids, 2, draft="mtp", sampler=partial(li.sample, temperature=1.0))[0] for _ in range(400)]
    expected = np.zeros(li.W["model.embed_tokens.weight"].shape[0])
    seen = np.zeros_like(expected)
    probs = {}
    for first, second in draws:
        if first not in probs:
            logits = li.forward(ids + [first], [None] * li.N_LAYERS, 0)[-1]
            probs[first] = np.array(mx.softmax(logits.astype(mx.float32)))
        expected += probs[first]
        seen[second] += 1
    tv = 0.5 * np.abs(seen - expected).sum() / len(draws)
    assert tv < 0.12, tv


def test_the_head_is_loaded_and_checked(qwen35, tmp_path):
    """Its 15 tensors, shapes from the config, norms made gains; one missing: a clear line."""
    folder = qwen35(mtp="random")
    li.load(folder)
    names = [n for n in li.W if n.startswith("mtp.")]
    assert len(names) == 15
    stored = mx.load(str(Path(folder) / "model.safetensors"))
    assert mx.array_equal(li.W["mtp.norm.weight"], stored["mtp.norm.weight"] + 1).item()
    assert li.W["model.layers.4.self_attn.q_proj.weight"] is li.W["mtp.layers.0.self_attn.q_proj.weight"]
    broken = Path(shutil.copytree(folder, tmp_path / "broken"))
    del stored["mtp.layers.0.mlp.up_proj.weight"]
    mx.save_safetensors(str(broken / "model.safetensors"), stored)
    assert_error(run_cli("--model", str(broken), "-m", "2"),
                 "tensor mtp.layers.0.mlp.up_proj.weight is missing")


def test_command_line(qwen35, checkpoint):
    agreeing = str(qwen35(mtp="agree", layers_scale=0.0))
    plain = run_cli("--model", agreeing, "-m", "12")
    r = run_cli("--model", agreeing, "-m", "12", "--draft", "mtp")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("==========")[1] == plain.stdout.split("==========")[1]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("Draft: ") and "tokens drafted by the MTP head" in last and "(100%)" in last
    r = run_cli("--model", str(checkpoint()), "-m", "8", "--draft", "lookup", "--num-draft-tokens", "2",
                "--chat", "--prompt", "Hi")
    assert r.returncode == 0 and "drafted by prompt lookup" in r.stdout, r.stderr
    assert_error(run_cli("--model", str(qwen35(mtp="none")), "--draft", "mtp"), "has no MTP head")
    assert_error(run_cli("--model", str(checkpoint()), "--draft", "mtp"), "has no MTP head")
    assert_error(run_cli("--model", agreeing, "--draft", "mtp", "--num-draft-tokens", "2"),
                 "--draft mtp drafts 1 token at a time")
    assert_error(run_cli("--model", agreeing, "--num-draft-tokens", "2"), "--num-draft-tokens needs --draft")
    assert_error(run_cli("--model", agreeing, "--draft", "lookup", "-p", "a", "-p", "b"),
                 "--draft decodes one prompt at a time")
    explained = run_cli("--model", agreeing, "-m", "4", "--draft", "mtp", "--explain")
    assert explained.returncode == 0 and "block 4" in explained.stdout, explained.stderr


def test_a_folder_without_the_head_runs_as_today(qwen35):
    r = run_cli("--model", str(qwen35(mtp="none")), "-m", "4")
    assert r.returncode == 0 and "; no MTP head): " in r.stdout.splitlines()[0], r.stderr
