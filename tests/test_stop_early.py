"""A generator stopped early (issue: "the cache after any yield"). generate()'s promise: after any
id a generator yields, the cache holds the prompt and every id yielded, nothing more -- a Qwen3.5
DeltaNet state exactly at the last id yielded, no drafting notes (a third entry, a list) left
attached; a KV buffer may hold stale later positions, which are written over before anything
reads them. It must hold for generate() and generate_draft() (the MTP head's drafts, prompt
lookup's) at every yield, however the caller stops: a break with the generator still referenced,
itertools.islice, gen.close(), an exception raised in the caller's own loop.

Each test stops a greedy float32 run after its k-th id, for k = 1..N, then continues on that cache
and compares with a cache freshly prefilled with the prompt and those k ids: the logits of a few
further ids and the ids generated after them."""
import gc
import itertools

import mlx.core as mx
import pytest

import llm_inference as li

# The same weights and float32 operations; the cache filled a token (or a verify pass) at a time
# here, in one prefill there. On this CPU the logits come out bit for bit equal (measured: 0); a
# backend whose matrix products of 1 and of L rows sum in another order may differ in the last bits
# (as test_draft's HEAD_TOL allows: 1e-5). A cache that lacks the last id, or holds a DeltaNet
# state an id off, moves them by 0.05 to 1.4 of the largest logit (measured).
TOL = 1e-5


class Stop(Exception):
    """Raised in the caller's own loop."""


def stop_after(gen, k, way):
    """The first k ids of gen, stopping it the given way; gen stays referenced by the caller
    (but for "close", which ends it)."""
    ids = []
    if way == "break":
        for token in gen:
            ids.append(token)
            if len(ids) == k:
                break
    elif way == "islice":
        ids = list(itertools.islice(gen, k))
    elif way == "close":
        ids = [next(gen) for _ in range(k)]
        gen.close()
    elif way == "raise":
        with pytest.raises(Stop):
            for token in gen:
                ids.append(token)
                if len(ids) == k:
                    raise Stop
    return ids


WAYS = ["break", "islice", "close", "raise"]  # rotated over k: each k stopped one way


def rel_err(ours, ref):
    return (mx.abs(ours - ref).max() / mx.abs(ref).max()).item()


def extra_entries(cache):
    """The cache entries that hold more than their two arrays -> {layer: what}."""
    return {i: f"{len(entry)} elements" + (f", a list of {len(entry[2])} kept states"
                                           if isinstance(entry[2], list) else "")
            for i, entry in enumerate(cache) if entry is not None and len(entry) > 2}


def check_continuation(prompt, full, k, cache):
    """cache, after a run stopped at its k-th id, continued with the next 2 ids of the greedy answer
    full: their logits against a fresh prefill's, then 4 ids generated after them against full's
    -> a list of what went wrong."""
    problems, at, after = [], len(prompt) + k, full[k:k + 2]
    extra = extra_entries(cache)
    if extra:
        problems.append(f"drafting notes left attached: {extra}")
    fresh = [None] * li.N_LAYERS
    li.prefill(prompt + full[:k], fresh)
    ref = li.prefill(after, fresh, at)
    ours = li.prefill(after, cache, at)
    err = rel_err(ours, ref)
    if not err < TOL:
        problems.append(f"the next ids' logits differ from a fresh prefill's by {err:.2g} of the "
                        "largest")
    more = list(li.generate(after, max_tokens=4, cache=cache, start=at, logits=ours))
    if more != full[k + 2:k + 6]:
        problems.append(f"continued: {more}, a fresh run: {full[k + 2:k + 6]}")
    return problems


# (model, prompt, N): a greedy answer long enough, and for lookup repetitive enough that drafts
# are accepted within its first N ids (Qwen3: drafts of 3 accepted whole; Qwen3.5: a draft of 2 of
# which the first is accepted, so its DeltaNet must go back one id).
CASES = {
    "generate-qwen3": ("qwen3", "The capital of France is", 6, None),
    "generate-qwen35": ("qwen35", "a a a a a a a a", 6, None),
    "mtp-qwen35": ("qwen35-mtp", "Once upon a time there was a small model that", 10, "mtp"),
    "lookup-qwen3": ("qwen3", "1 2 3 1 2 3 1 2 3 1 2", 14, "lookup"),
    "lookup-qwen35": ("qwen35", "a a a a a a a a", 8, "lookup"),
}


def new_drafter(draft):  # a drafter for one generate_draft() call: the MTP head's, or lookup's 3
    return li.MTPDrafter() if draft == "mtp" else li.PromptLookup(3)


def load(checkpoint, qwen35, model):
    li.load({"qwen3": checkpoint, "qwen35": lambda: qwen35(tied=False),
             "qwen35-mtp": lambda: qwen35(mtp="agree", layers_scale=2.0)}[model]())


@pytest.mark.parametrize("case", list(CASES))
def test_a_generator_stopped_after_any_id_leaves_the_prompt_and_its_ids(checkpoint, qwen35, case):
    """For k = 1..N: the run stopped after its k-th id (the ways rotated over k), then continued on
    that cache, equals a cache freshly prefilled with the prompt and the k ids (logits within TOL,
    the ids after them equal); no cache entry holds more than its two arrays. A drafting run (the
    one stopped at N) must have had a draft accepted, so that a stop at an accepted draft's id is
    among them."""
    model, text, n, draft = CASES[case]
    load(checkpoint, qwen35, model)
    prompt = li.tokenize(text)
    full = list(li.generate(prompt, max_tokens=n + 6))
    assert len(full) == n + 6  # no EOS on the way
    problems = []
    for k in range(1, n + 1):
        way, cache, counts = WAYS[k % len(WAYS)], [None] * li.N_LAYERS, {}
        gen = li.generate_draft(prompt, max_tokens=n + 6, drafter=new_drafter(draft), cache=cache,
                                counts=counts) if draft else li.generate(prompt, n + 6, cache=cache)
        ids = stop_after(gen, k, way)
        assert ids == full[:k], (k, way)
        problems += [f"k={k} ({way}): {p}" for p in check_continuation(prompt, full, k, cache)]
        del gen
    if draft:
        assert counts["accepted"] > 0, counts  # an accepted draft among the first N ids
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("draft", ["mtp", "lookup"])
def test_a_long_prefill_after_a_stop_keeps_two_arrays_a_layer(qwen35, draft):
    """A Qwen3.5 drafting run stopped (break, the generator kept) right after an accepted draft's
    id, then a 200-token prefill continued on that cache: every entry holds its two arrays, no
    more (a notes list left attached would be given a state for every one of the 200 tokens), and
    the logits equal a fresh prefill's of the whole (TOL, as above)."""
    model, text, _, _ = CASES[f"{draft}-qwen35"]
    load(None, qwen35, model)
    prompt = li.tokenize(text)
    cache, counts, ids = [None] * li.N_LAYERS, {}, []
    gen = li.generate_draft(prompt, max_tokens=20, drafter=new_drafter(draft), cache=cache,
                            counts=counts)
    for token in gen:
        ids.append(token)
        if counts["accepted"]:  # this id is the first accepted draft (yielded after the count)
            break
    assert counts["accepted"] and len(ids) < 20, (counts, ids)
    long = li.tokenize(" The capital of France is Paris." * 40)[:200]
    assert len(long) == 200
    at = len(prompt) + len(ids)
    ours = li.prefill(long, cache, at)
    assert not extra_entries(cache), extra_entries(cache)
    err = rel_err(ours, li.prefill(prompt + ids + long, [None] * li.N_LAYERS))
    assert err < TOL, err
    del gen
    gc.collect()
