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
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer
from mlx_lm.utils import load_model

import llm_inference as li
from test_cli_errors import assert_error, run_cli

TEXTS = ["The capital of France is", "a", "Once upon a time there was a small model that",
         "The capital of France is Paris. The capital of Japan is Tokyo. The capital of France is"]
HEADS = [dict(mtp="random"), dict(mtp="agree", layers_scale=2.0), dict(mtp="agree", layers_scale=0.0)]


def new_drafter(draft, start=0, k=3):
    """A drafter of that kind for one generate_draft() call (the MTP head's cache is its own)."""
    return li.MTPDrafter(start) if draft == "mtp" else li.PromptLookup(k)


def drafted(ids, n, draft, k=3, **options):
    counts = {}
    return list(li.generate_draft(ids, max_tokens=n, drafter=new_drafter(draft, k=k),
                                  counts=counts, **options)), counts


@pytest.mark.parametrize("head", HEADS, ids=["random", "in-between", "agreeing"])
def test_mtp_drafts_give_generates_ids(qwen35, head):
    """A random head (its drafts mostly rejected), one built to agree with the model (accepted),
    one in between: the same ids as generate(), on a model whose DeltaNet layers matter."""
    li.load(qwen35(**head))
    total = {"drafted": 0, "accepted": 0}
    for text in TEXTS:
        ids = li.tokenize(text)
        ours, counts = drafted(ids, 24, "mtp")
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
    ours, counts = drafted(ids, 30, "mtp")
    assert ours == list(li.generate(ids, max_tokens=30)) and len(set(ours)) > 5
    assert counts["accepted"] == counts["drafted"] > 10


@pytest.mark.parametrize("model", ["qwen3", "qwen35"])
@pytest.mark.parametrize("k", [1, 3])
def test_prompt_lookup_gives_generates_ids(checkpoint, qwen35, model, k):
    li.load(checkpoint() if model == "qwen3" else qwen35(mtp="none"))
    for text in TEXTS + ["a a a a a a a a", "1 2 3 1 2 3 1 2 3 1 2"]:
        ids = li.tokenize(text)
        assert drafted(ids, 20, "lookup", k)[0] == list(li.generate(ids, max_tokens=20))


def lookup(history, n_draft):  # PromptLookup's drafts after history (its last id: the token)
    return li.PromptLookup(n_draft).draft(history[:-1], history[-1], None).tolist()


def test_lookup_drafts_what_followed_before():
    history = [5, 6, 7, 8, 9, 5, 6, 7]
    assert lookup(history, 2) == [8, 9] and lookup(history, 5) == [8, 9, 5, 6, 7]
    assert lookup([1, 2, 3], 2) == [] and lookup([4, 4], 3) == [4]


def test_a_chunked_prompt_and_the_contexts_end(qwen35):
    """A prompt longer than a chunk (4 here), through the model and the MTP head, and a context
    that ends mid-draft: the same ids, and the same drafts accepted as unchunked."""
    li.load(qwen35(mtp="agree", layers_scale=2.0, max_position_embeddings=40))
    ids = li.tokenize(TEXTS[2])
    assert len(ids) > 8
    for draft in ("mtp", "lookup"):
        cache, counts = [None] * li.N_LAYERS, {}
        hidden = li.hidden_pass(ids, cache, 0, chunk=4)
        drafter = li.MTPDrafter(chunk=4) if draft == "mtp" else li.PromptLookup()
        ours = list(li.generate_draft(ids, 100, drafter=drafter, cache=cache, hidden=hidden,
                                      counts=counts))
        assert ours == list(li.generate(ids, max_tokens=100)) and len(ours) == 40 - len(ids)
        assert counts == drafted(ids, 100, draft)[1] and counts["accepted"] > 0


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
        assert list(li.generate_draft(ids, max_tokens=20, drafter=li.MTPDrafter(), cache=cache)) == free[:j]
        continued = list(li.generate(after, max_tokens=4, cache=cache, start=len(ids) + j))
        assert continued == list(li.generate(ids + free[:j] + after, max_tokens=4))


@pytest.mark.parametrize("draft", ["mtp", "lookup"])
def test_the_cache_holds_what_was_yielded(qwen35, draft):
    """Rejected drafts leave nothing behind: continuing from the cache equals a fresh run on the
    prompt and the ids yielded (a chat turn's next prompt continues a cache this way)."""
    li.load(qwen35(mtp="agree", layers_scale=2.0))
    ids = li.tokenize(TEXTS[3])
    cache = [None] * li.N_LAYERS
    ours = list(li.generate_draft(ids, max_tokens=15, drafter=new_drafter(draft), cache=cache))
    after = li.tokenize(" Next")
    assert list(li.generate_draft(after, max_tokens=8, drafter=new_drafter(draft, len(ids) + 15),
                                  cache=cache, start=len(ids) + 15)) == \
        list(li.generate(ids + ours + after, max_tokens=8))


def test_sampling_keeps_the_models_distribution(qwen35):
    """At temperature 1 the second id, drawn 400 times with drafting, against the model's own
    probabilities given each first id: the total variation between the counts and their
    expectation is within what 400 draws allow (a draft that biased the choice would exceed it)."""
    li.load(qwen35(mtp="agree", layers_scale=2.0))
    ids = li.tokenize(TEXTS[0])
    mx.random.seed(0)
    draws = [drafted(ids, 2, "mtp", sampler=partial(li.sample, temperature=1.0))[0] for _ in range(400)]
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


# ═══ The MTP head against mlx-lm's pieces (issue "Part II as plain as Part I") ═══
# The heads above are never accepted (random) or built to ignore h_t (agree), so a wrong position,
# an empty head cache or a pre-norm h_t moves no count there. Here the head's logits are checked,
# row by row, against a head assembled from mlx-lm's own layers on the same 15 tensors.
class ReferenceHead:
    """Qwen3.5's MTP head from mlx-lm's code: mlx_lm.utils.load_model() gives the model (h_t: its
    Qwen3_5TextModel's output, which ends with the final norm; the embedding; the LM head), and
    mlx_lm.models.qwen3_5.DecoderLayer, a full-attention one (layer index 3 of 4), loaded with the
    mtp.layers.0.* tensors, is the head's layer, on mlx-lm's own KVCache (RoPE from its offset).
    mlx-lm's sanitize() drops every mtp.* tensor, so they are read here with mx.load; Hugging
    Face's Qwen3.5 stores each norm as an offset from 1 (its RMSNorm multiplies by 1 + weight), so
    1 is added to each of the head's 7 norms (every mtp.* name holding "norm"), as sanitize() does
    to the model's and read_weights() to all. The head: e = RMSNorm(embed(x_t+1)), h =
    RMSNorm(h_t), x = fc([e; h]), the layer, RMSNorm (mtp.norm), the model's LM head."""

    def __init__(self, folder):
        self.model, _ = load_model(Path(folder))
        text = self.model.language_model
        self.args, self.text = text.args, text
        stored = mx.load(str(Path(folder) / "model.safetensors"))
        mtp = {name[len("mtp."):]: w + 1 if "norm" in name else w
               for name, w in stored.items() if name.startswith("mtp.")}
        assert len(mtp) == 15 and sum("norm" in name for name in mtp) == 7
        self.layer = DecoderLayer(self.args, self.args.full_attention_interval - 1)
        assert not self.layer.is_linear
        self.layer.load_weights([(name[len("layers.0."):], w) for name, w in mtp.items()
                                 if name.startswith("layers.0.")], strict=True)
        self.mtp, self.cache = mtp, KVCache()

    def hidden(self, ids):
        """h_t for each id (L, D): the model's last hidden states, after its final norm."""
        return self.text.model(mx.array(ids)[None])[0]

    def logits(self, tokens, hidden):
        """x_t+1 (L,), h_t (L, D) at the next L positions of its cache -> logits (L, vocab)."""
        eps, m = self.args.rms_norm_eps, self.mtp
        e = mx.fast.rms_norm(self.text.model.embed_tokens(mx.array(tokens)),
                             m["pre_fc_norm_embedding.weight"], eps)
        h = mx.fast.rms_norm(hidden, m["pre_fc_norm_hidden.weight"], eps)
        x = (mx.concatenate([e, h], axis=-1) @ m["fc.weight"].T)[None]  # (1, L, D)
        x = self.layer(x, create_attention_mask(x, self.cache), self.cache)[0]
        x = mx.fast.rms_norm(x, m["norm.weight"], eps)
        if self.args.tie_word_embeddings:
            return self.text.model.embed_tokens.as_linear(x)
        return self.text.lm_head(x)


def rel_err(ours, ref):
    return (mx.abs(ours - ref).max() / mx.abs(ref).max()).item()


HEAD_TOL = 1e-5  # float32, the same operations in another order (measured: 2e-7 to 5e-7)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_heads_logits_equal_mlx_lms_layers(qwen35, tied):
    """mtp_logits() against ReferenceHead, in float32, on a random head (whose logits depend on
    every input: the token, h_t, the keys of the positions before): over a prompt (pairs
    (x_t+1, h_t) at positions 0..L-2, filling the head's cache), then continued on that cache one
    position at a time and then two at once. h_t: hidden_pass()'s, itself checked against
    mlx-lm's model (after its final norm). A query at the wrong position (seeing the key after
    its own), h_t before the final norm, [h; e] for [e; h] or a missing norm move the logits by
    far more (measured: 0.03 to 0.36 of the largest logit for the first two). Tolerance 1e-5 of
    the largest logit: float32 through the same operations in another order (measured 2e-7 to
    5e-7; hidden states 1e-7 to 3e-7). A shift of every RoPE position of the head, its queries'
    and its keys' alike, is no error and does not show: attention sees only their difference."""
    folder = qwen35(mtp="random", tied=tied)
    li.load(folder)
    ids, more = li.tokenize(TEXTS[3]), li.tokenize(" Paris. The capital of Japan")
    assert len(more) >= 3
    ref = ReferenceHead(folder)
    h_ref = ref.hidden(ids + more)                                    # (L + M, D)
    cache, mtp_cache = [None] * li.N_LAYERS, [None] * (li.N_LAYERS + 1)
    hidden = li.hidden_pass(ids, cache, 0)
    err = {"hidden": rel_err(hidden, h_ref[:len(ids)])}
    ours = li.mtp_logits(mx.array(ids[1:]), hidden[:-1], mtp_cache, 0)
    err["prompt"] = rel_err(ours, ref.logits(ids[1:], h_ref[:len(ids) - 1]))
    hidden = mx.concatenate([hidden, li.hidden_pass(more, cache, len(ids))])
    err["hidden, continued"] = rel_err(hidden, h_ref)
    history, t = ids + more, len(ids) - 1                             # the next pair's position
    for n in (1, 1, 2):
        ours = li.mtp_logits(mx.array(history[t + 1:t + 1 + n]), hidden[t:t + n], mtp_cache, t)
        err[f"position {t}"] = rel_err(ours, ref.logits(history[t + 1:t + 1 + n], h_ref[t:t + n]))
        t += n
    print(", ".join(f"{k} {v:.1e}" for k, v in err.items()))
    assert max(err.values()) < HEAD_TOL, err


def recording_head(monkeypatch):
    """li.mtp_logits wrapped: each call's ids, h_t rows, start position and logits, in order."""
    calls, mtp_logits = [], li.mtp_logits

    def recorded(tokens, hidden, mtp_cache, start, first=0):
        logits = mtp_logits(tokens, hidden, mtp_cache, start, first)
        calls.append((np.array(tokens).tolist(), hidden, start, logits))
        return logits

    monkeypatch.setattr(li, "mtp_logits", recorded)
    return calls


@pytest.mark.parametrize("text", [TEXTS[2], TEXTS[3]], ids=["short", "long"])
def test_every_draft_comes_from_the_whole_history(qwen35, monkeypatch, text):
    """generate_draft() with a random head whose logits depend on h_t and on the keys of every
    earlier position: each call of mtp_logits() it makes, over the prompt and at every decoded
    position, against ReferenceHead run once over the whole history (prompt and ids yielded,
    pairs (x_t+1, h_t) at positions t = 0, 1, ...; h_t from mlx-lm's model, after its final
    norm). Its ids are the model's x_t+1 at start.., its rows are h_t (after the final norm, also
    those of the passes that checked drafts), its logits the reference's rows (tolerance: as
    test_the_heads_logits_equal_mlx_lms_layers), and the calls fill the head's cache at each
    position once, in order from 0 (the prompt's pairs before the first draft). A head cache
    left empty over the prompt, a position off by one, or h_t read before the final norm (in
    hidden_pass() or after a pass that checked drafts) fails here."""
    li.load(qwen35(mtp="random"))
    ids = li.tokenize(text)
    calls = recording_head(monkeypatch)
    ours = list(li.generate_draft(ids, max_tokens=16, drafter=li.MTPDrafter()))
    assert ours == list(li.generate(ids, max_tokens=16))
    history = ids + ours
    ref = ReferenceHead(qwen35(mtp="random"))
    h_ref = ref.hidden(history)
    ref_logits = ref.logits(history[1:], h_ref[:-1])                  # (L + n - 1, vocab)
    end = 0  # the head's cache is filled at each position once, in order, from position 0
    for tokens, hidden, start, logits in calls:
        where = slice(start, start + len(tokens))
        assert tokens == history[where.start + 1:where.stop + 1], start
        err = rel_err(hidden, h_ref[where]), rel_err(logits, ref_logits[where])
        assert max(err) < HEAD_TOL, (start, err)
        assert start == end, (start, end)
        end = where.stop
    assert end >= len(history) - 2  # every pair up to the last id's (no draft after it)


def test_an_eos_the_head_drafts_and_the_model_chooses_ends_the_ids(qwen35, monkeypatch):
    """A head whose every draft stands (agreeing, layers_scale 0, untied: no id drafts itself), so
    with k = 1 the ids alternate: the model's own from the pass before, then a draft it accepted
    (ids 1, 3, 5, ... are drafts). Each id that first appears at its place made an EOS id in turn,
    half of them at a draft's place, where the head drafts the EOS and the model chooses it too:
    the ids stop before it, as generate()'s do, nothing after it, and the cache holds exactly
    the ids yielded. (test_eos_inside_an_accepted_draft's head drafts only repeats, which never
    first appear, so no EOS id of its sits at an accepted draft's place.)"""
    li.load(qwen35(mtp="agree", layers_scale=0.0, tied=False))
    ids = li.tokenize(TEXTS[2])
    free, eos, after = list(li.generate(ids, max_tokens=16)), li.EOS_IDS, li.tokenize(" more")
    ours, counts = drafted(ids, 16, "mtp")
    assert ours == free and counts["accepted"] == counts["drafted"] == 8  # ids 1, 3, .., 15
    new = [j for j in range(1, 16) if free[j] not in free[:j]]
    assert sum(j % 2 for j in new) >= 4, new  # EOS ids the head drafts and the model accepts
    for j in new:
        monkeypatch.setattr(li, "EOS_IDS", eos | {free[j]})
        cache = [None] * li.N_LAYERS
        assert list(li.generate(ids, max_tokens=16)) == free[:j]
        assert list(li.generate_draft(ids, max_tokens=16, drafter=li.MTPDrafter(), cache=cache)) == free[:j], j
        continued = list(li.generate(after, max_tokens=3, cache=cache, start=len(ids) + j))
        assert continued == list(li.generate(ids + free[:j] + after, max_tokens=3)), j


def poison_one_logit(monkeypatch, ids, free, i):
    """Every LM head product whose input row is the model's final-normed hidden state that
    predicts free[i] (position len(ids) - 1 + i) gets a NaN in one logit, id 7, of that row only:
    the logits before and after it stay finite, wherever and however often they are computed."""
    target = li.hidden_pass(ids + free, [None] * li.N_LAYERS, 0)[len(ids) - 1 + i]  # (D,)
    linear = li.linear

    def poisoned(x, name):
        out = linear(x, name)
        if name != "lm_head":
            return out
        hit = mx.all(mx.abs(x - target) < 1e-4, axis=-1, keepdims=True)  # (L, 1)
        return mx.where(hit & (mx.arange(out.shape[-1]) == 7), mx.nan, out)

    monkeypatch.setattr(li, "linear", poisoned)


def yielded_then_raised(ids):
    """The ids a generator yielded before it raised FloatingPointError (it must raise)."""
    out = []
    with pytest.raises(FloatingPointError, match=r"^the logits .* not finite \(NaN or inf\) in "
                       r"float32"):
        for token in ids:
            out.append(token)
    return out


@pytest.mark.parametrize("head, i", [("random", 0), ("random", 2), ("random", 5), ("agreeing", 0),
                                     ("agreeing", 2), ("agreeing", 5)])
def test_one_nan_logit_raises_as_generate_does(qwen35, monkeypatch, head, i):
    """One NaN among the logits that choose the i-th id (a single logit of one row: the others
    finite, so a check that asks whether any logit is finite passes it): generate_draft() yields
    what generate() yields before that id and raises FloatingPointError, naming float32, as it
    does. The random head's drafts are rejected: each id is chosen from the logits checked next;
    the agreeing head's all stand (ids 1, 3, 5, ... are accepted drafts), so an even i's logits
    are the last row of a pass that checked a draft (i = 0: the prompt's), and i = 5's are the
    first row of a pass that checked the draft for id 5 -- with the head seeing the same NaN and
    drafting id 7, which the model's NaN row chooses too: each row of a pass is checked before
    the id it chose is yielded."""
    li.load(qwen35(mtp="random") if head == "random" else
            qwen35(mtp="agree", layers_scale=0.0, tied=False))
    ids = li.tokenize(TEXTS[2])
    free, counts = drafted(ids, 10, "mtp")
    assert free == list(li.generate(ids, max_tokens=10))
    assert counts["accepted"] == (0 if head == "random" else counts["drafted"])
    poison_one_logit(monkeypatch, ids, free, i)
    assert yielded_then_raised(li.generate(ids, max_tokens=10)) == free[:i]
    assert yielded_then_raised(li.generate_draft(ids, max_tokens=10, drafter=li.MTPDrafter())) == free[:i]
