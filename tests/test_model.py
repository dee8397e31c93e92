"""llm_inference.py against the references, on tiny random-weight Qwen3 checkpoints.

Error measure everywhere: max |ours - ref| over the whole logits matrix, divided by max |ref|
(a relative error that a few near-zero logits cannot inflate).
"""
import importlib
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

import llm_inference as li
from test_cli_errors import save_weights

TEXT = "The capital of France is Paris. 日本の首都は東京です。 Emoji 😀 ❤️!"


def rel_err(ours, ref):
    ours, ref = ours.astype(mx.float32), ref.astype(mx.float32)
    return (mx.abs(ours - ref).max() / mx.abs(ref).max()).item()


def ours_logits(folder, ids):
    li.load(folder)
    return li.forward(ids, [None] * li.N_LAYERS, 0)


def mlx_lm_logits(folder, ids, dtype=None):
    model, _ = load_model(Path(folder))
    if dtype is not None:
        model.set_dtype(dtype)
    return model(mx.array(ids)[None])[0]


@pytest.mark.parametrize("options", [
    dict(), dict(lm_head="tied"), dict(lm_head="tied_stored"), dict(rope="nested"),
    dict(shards=3), dict(lm_head="tied", rope="nested", shards=2),
    dict(init="realistic"), dict(init="realistic", lm_head="tied_stored"),
], ids=["untied", "tied", "tied_stored", "rope_nested", "sharded", "tied_nested_sharded",
        "realistic", "realistic_tied"])
def test_float32_logits_equal_mlx_lm(checkpoint, tokenizer, options):
    folder = checkpoint(**options)
    ids = tokenizer.encode(TEXT).ids
    ours, ref = ours_logits(folder, ids), mlx_lm_logits(folder, ids)
    assert ours.shape == ref.shape == (len(ids), 640)
    assert ours.dtype == mx.float32
    # float32 through 3 layers: the two differ only in summation order and in mx.fast kernels
    # (rope, rms_norm, sdpa) vs the formulas written out here; measured ~1e-6, a wrong formula
    # (e.g. interleaved RoPE, missing QK-norm) gives 1e-2 or more. With realistic weights
    # (std 0.02) activations are small and eps matters: eps outside the square root gives ~1e-3.
    assert rel_err(ours, ref) < 1e-4
    assert (mx.argmax(ours, -1) == mx.argmax(ref, -1)).all().item()


@pytest.mark.parametrize("init", ["unit", "realistic"])
def test_bfloat16_as_accurate_as_mlx_lm(checkpoint, tokenizer, init):
    """bfloat16 has an 8-bit mantissa (relative step 2^-8 = 0.4%): neither implementation can
    match float32 exactly, and they round at different places. The justified bound: our bf16
    logits are no further from the exact answer (the same bf16 weights run in float32) than
    mlx-lm's own bf16 logits are, give or take a factor of 2, and the two bf16 results differ
    by no more than the sum of their errors."""
    folder = checkpoint(dtype="bfloat16", init=init)
    ids = tokenizer.encode(TEXT).ids
    ours = ours_logits(folder, ids)
    assert ours.dtype == mx.bfloat16  # nothing silently promoted the model to float32
    ref_bf16 = mlx_lm_logits(folder, ids)
    exact = mlx_lm_logits(folder, ids, dtype=mx.float32)  # bf16 -> f32 is lossless
    err_ours, err_ref = rel_err(ours, exact), rel_err(ref_bf16, exact)
    print(f"bf16 error vs exact: ours {err_ours:.2e}, mlx-lm {err_ref:.2e}")
    assert err_ref > 0  # the reference really ran in bfloat16
    assert err_ours <= 2 * err_ref
    assert rel_err(ours, ref_bf16) <= err_ours + err_ref


def test_float32_logits_equal_transformers(checkpoint, tokenizer):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ids = tokenizer.encode(TEXT).ids
    for options in [dict(), dict(lm_head="tied", rope="nested"), dict(shards=3), dict(init="realistic")]:
        folder = checkpoint(**options)
        model = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].numpy()
        # float32 vs PyTorch's float32 kernels: summation order only (measured ~1e-6).
        assert rel_err(ours_logits(folder, ids), mx.array(ref)) < 1e-4


def test_decode_steps_with_cache_equal_full_forward(checkpoint, tokenizer):
    li.load(checkpoint())
    ids = tokenizer.encode(TEXT).ids
    full = li.forward(ids, [None] * li.N_LAYERS, 0)                   # (L, vocab), no cache
    cache = [None] * li.N_LAYERS
    rows = [li.forward(ids[:5], cache, 0)]                            # prefill 5
    for pos in range(5, len(ids)):                                    # then one token at a time
        rows.append(li.forward([ids[pos]], cache, pos))
    assert rel_err(mx.concatenate(rows), full) < 1e-5
    assert cache[0][0].shape == (li.N_KV, 256, li.D_HEAD)  # a buffer: room for 256 positions


@pytest.mark.parametrize("steps", [[255, 1, 1], [256, 1, 1], [257, 1], [250, 12, 1], [3, 300, 2, 1],
                                   [512, 1], [100, 100, 100, 100, 113]])
def test_cache_across_buffer_growth_equals_full_forward(checkpoint, tokenizer, steps):
    """The cache grows 256 positions at a time: one token before, at and after a boundary,
    chunks that cross one (or two), and a chunk that fills it exactly all equal a full forward."""
    li.load(checkpoint())
    ids = (tokenizer.encode(TEXT * 30).ids)[:sum(steps)]
    full = li.forward(ids, [None] * li.N_LAYERS, 0)
    cache, rows, pos = [None] * li.N_LAYERS, [], 0
    for n in steps:
        rows.append(li.forward(ids[pos:pos + n], cache, pos))
        pos += n
        assert cache[0][0].shape[1] == -(-pos // 256) * 256  # the room: whole blocks of 256
    assert rel_err(mx.concatenate(rows), full) < 1e-5


def test_chunk_on_nonempty_cache_equals_full_forward(checkpoint, tokenizer):
    """A chunk of several tokens at offset p must see keys up to p+i (the mask-offset bug)."""
    li.load(checkpoint())
    ids = tokenizer.encode(TEXT).ids
    full = li.forward(ids, [None] * li.N_LAYERS, 0)
    cache = [None] * li.N_LAYERS
    a = li.forward(ids[:7], cache, 0)
    b = li.forward(ids[7:16], cache, 7)                               # 9 tokens onto 7 cached
    c = li.forward(ids[16:], cache, 16)
    assert rel_err(mx.concatenate([a, b, c]), full) < 1e-5


def test_long_context_with_cache(checkpoint, tokenizer):
    """Several hundred tokens: chunked prefill + decode equals mlx-lm's full forward."""
    folder = checkpoint()
    ids = (tokenizer.encode(TEXT * 20).ids)[:400]
    assert len(ids) == 400
    ref = mlx_lm_logits(folder, ids)
    li.load(folder)
    cache = [None] * li.N_LAYERS
    rows = [li.forward(ids[:300], cache, 0), li.forward(ids[300:390], cache, 300)]
    rows += [li.forward([t], cache, p) for p, t in enumerate(ids[390:], 390)]
    assert rel_err(mx.concatenate(rows), ref) < 1e-4


MANTISSA_BITS = {mx.bfloat16: 7, mx.float16: 10, mx.float32: 23}


def mlx_lm_greedy(folder, ids, n, dtype=None):
    """mlx-lm's greedy decoding, n steps after ids, its model in dtype (or the checkpoint's own)
    and alone in memory: loaded here, let go on return. -> its ids, its two likeliest logits at
    each step, and its logits for the prompt's last token."""
    model, _ = load_model(Path(folder))
    if dtype is not None:
        model.set_dtype(dtype)
    cache = make_prompt_cache(model)
    logits = prompt_logits = model(mx.array(ids)[None], cache=cache)[0, -1]
    ref_ids, top2s = [], []
    for _ in range(n):
        top2s.append(mx.sort(logits.astype(mx.float32))[-2:].tolist())
        ref_ids.append(mx.argmax(logits).item())
        logits = model(mx.array([ref_ids[-1:]]), cache=cache)[0, -1]
    mx.eval(prompt_logits)
    return ref_ids, top2s, prompt_logits


def greedy_along_mlx_lm(ids, ref_ids, top2s, ref_prompt_logits):
    """Our loaded model, teacher-forced along mlx-lm's greedy ids (so that one tie cannot derail
    the rest). At each step our argmax must be mlx-lm's, except where mlx-lm's two likeliest logits
    are within bound = one step of the dtype at the top logit (two values that close can round to
    one) + delta (the largest difference between our logits and mlx-lm's for the prompt's last
    token, the row a decoding step computes): there either choice is right, a tie, not compared.
    Fails if more than a quarter of the steps are ties (a checkpoint of ties proves nothing).
    Returns the number of steps before the first tie (generate() must agree that far)."""
    cache = [None] * li.N_LAYERS
    ours = li.prefill(ids, cache)
    delta = mx.abs(ours.astype(mx.float32) - ref_prompt_logits.astype(mx.float32)).max().item()
    ties, first_tie = 0, len(ref_ids)
    for step, (ref, top2) in enumerate(zip(ref_ids, top2s)):
        bound = 2.0 ** (math.floor(math.log2(abs(top2[1]))) - MANTISSA_BITS[ours.dtype]) + delta
        if top2[1] - top2[0] <= bound:
            ties += 1
            first_tie = min(first_tie, step)
        else:
            assert mx.argmax(ours).item() == ref, f"step {step + 1}: not a tie"
        ours = li.forward([ref], cache, len(ids) + step)[-1]
    n = len(ref_ids)
    print(f"greedy in {ours.dtype}: {n - ties} of {n} steps compared, {ties} ties (delta {delta:.3g})")
    assert ties <= n / 4
    return first_tie


def assert_generate_agrees(ids, n, ref_ids, agreed):
    """generate()'s own ids equal mlx-lm's up to the first tie, and stop at its first EOS id."""
    ours = list(li.generate(ids, max_tokens=n))
    stop = next((i for i, t in enumerate(ref_ids) if t in li.EOS_IDS), n)
    if stop < agreed:
        assert ours == ref_ids[:stop]
    else:
        assert ours[:agreed] == ref_ids[:agreed]


@pytest.mark.parametrize("dtype, init", [("float32", "unit"), ("bfloat16", "unit"),
                                         ("float32", "realistic"), ("float32", "wide")])
def test_greedy_generation_equals_mlx_lm(checkpoint, tokenizer, dtype, init):
    folder = checkpoint(dtype=dtype, init=init)
    ids = tokenizer.encode("The capital of France is").ids
    ref, top2s, ref_logits = mlx_lm_greedy(folder, ids, 24)
    li.load(folder)
    agreed = greedy_along_mlx_lm(ids, ref, top2s, ref_logits)
    assert len(set(ref)) > 5  # the fixture is not degenerate: not one repeated token
    assert_generate_agrees(ids, 24, ref, agreed)


@pytest.mark.parametrize("where", ["config", "generation_config"])
def test_generation_stops_on_any_eos_id(checkpoint, tokenizer, where):
    ids = tokenizer.encode("The capital of France is").ids
    li.load(checkpoint())
    free_run = list(li.generate(ids, max_tokens=12))
    assert len(free_run) == 12
    stop = free_run[6]
    k = free_run.index(stop)  # first occurrence
    options = dict(eos_token_id=stop) if where == "config" else dict(eos_extra=[stop])
    li.load(checkpoint(**options))
    assert stop in li.EOS_IDS and len(li.EOS_IDS) == 3  # the union of both files' ids
    assert list(li.generate(ids, max_tokens=12)) == free_run[:k]


@pytest.mark.parametrize("load", ["load", "load_checked"])
def test_load_reads_every_constant_from_config(checkpoint, load):
    """Part I's plain load() and Part IV's load_checked() fill the same names."""
    cfg = getattr(li, load)(checkpoint(num_hidden_layers=2, head_dim=16, num_key_value_heads=1,
                                       eos_extra=[7]))
    assert (li.N_LAYERS, li.D_HEAD, li.N_KV, li.N_HEADS, li.D) == (2, 16, 1, 4, 64)
    assert li.THETA == 1e6 and li.EPS == 1e-6 and li.MAX_POS == 2048
    assert cfg["model_type"] == "qwen3" and 7 in li.EOS_IDS and len(li.EOS_IDS) == 3


def test_load_rejects_wrong_shape(checkpoint, tmp_path):
    import shutil
    folder = Path(shutil.copytree(checkpoint(), tmp_path / "m"))
    w = mx.load(str(folder / "model.safetensors"))
    w["model.layers.1.mlp.up_proj.weight"] = mx.zeros((3, 64))
    save_weights(folder / "model.safetensors", w)
    with pytest.raises(li.UserError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(160, 64\)"):
        li.load_checked(folder)
    del w["model.layers.1.mlp.up_proj.weight"]
    save_weights(folder / "model.safetensors", w)
    with pytest.raises(li.UserError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        li.load_checked(folder)


def test_import_loads_nothing():
    mod = importlib.reload(li)
    assert mod.W == {} and mod.TOK is None


def test_dtype_option_computes_in_float32(checkpoint, tokenizer):
    """--dtype float32 on bfloat16 weights: the same numbers as mlx-lm with those weights in float32."""
    folder = checkpoint(dtype="bfloat16")
    ids = tokenizer.encode(TEXT).ids
    li.load(folder, mx.float32)
    assert {w.dtype for w in li.W.values()} == {mx.float32}
    ours = li.forward(ids, [None] * li.N_LAYERS, 0)
    assert ours.dtype == mx.float32
    assert rel_err(ours, mlx_lm_logits(folder, ids, dtype=mx.float32)) < 1e-4


def test_generate_one_token_and_zero_room(checkpoint, tokenizer):
    li.load(checkpoint())
    ids = tokenizer.encode("The capital of France is").ids
    assert list(li.generate(ids, max_tokens=1)) == list(li.generate(ids, max_tokens=5))[:1]
    li.MAX_POS = len(ids)  # a full context: nothing more to generate
    try:
        assert list(li.generate(ids, max_tokens=5)) == []
    finally:
        li.load(checkpoint())


def test_prompt_longer_than_a_prefill_chunk(checkpoint, tokenizer):
    """prefill() runs a long prompt in chunks of 512: every chunk after the first must go in at
    its own positions. 1,100 tokens: chunks at 0, 512 and 1024, then the last token; its logits,
    and the next token's on that cache, equal mlx-lm's full forward."""
    folder = checkpoint()
    ids = tokenizer.encode(TEXT * 60).ids[:1101]
    assert len(ids) == 1101
    li.load(folder)
    cache = [None] * li.N_LAYERS
    last = li.prefill(ids[:-1], cache)                                 # (vocab,)
    after = li.forward(ids[-1:], cache, len(ids) - 1)[-1]              # (vocab,)
    ref = mlx_lm_logits(folder, ids)                                   # (1101, vocab)
    assert rel_err(mx.stack([last, after]), ref[-2:]) < 1e-4


def test_shared_positions_leave_one_prompt_token_to_compute():
    """The reply's first token comes from the logits of the prompt's last token, so that token
    is always computed, even when the whole prompt is in the cache already."""
    assert li.shared_positions([1, 2, 3, 4, 5], [1, 2, 3]) == 2                # a prefix of the cache
    assert li.shared_positions([1, 2, 3], [1, 2, 3]) == 2                      # the cache exactly
    assert li.shared_positions([1, 2, 3], [1, 2, 3, 4]) == 3
    assert li.shared_positions([1, 9, 3], [1, 2, 3, 4]) == 1
    assert li.shared_positions([], [7]) == 0


def test_prompt_already_cached_gives_the_fresh_answer(checkpoint, tokenizer):
    li.load(checkpoint())
    ids = tokenizer.encode("The capital of France is").ids
    cache = [None] * li.N_LAYERS
    mx.eval(li.forward(ids + ids[:3], cache, 0))                       # the prompt and more, cached
    n = li.shared_positions(ids + ids[:3], ids)
    assert list(li.generate(ids[n:], max_tokens=6, cache=cache, start=n)) == \
        list(li.generate(ids, max_tokens=6))


def test_the_articles_calls(checkpoint, tokenizer):
    """The article's generate(text) returns text; ours takes and yields ids, and given text it
    says, in one line, the call that does what the article's does. The article's sample(logits)
    on our forward()'s (L, vocab) logits gives each position's next token: the article's
    sample(logits[-1]) the last one's."""
    li.load(checkpoint())
    prompt = "The capital of France is"
    with pytest.raises(TypeError) as error:
        list(li.generate(prompt))
    call = "text + TOK.decode(list(generate(tokenize(text))))"  # the article's: prompt and answer
    assert str(error.value).endswith(call)
    text = eval(call, vars(li), {"text": prompt})  # the call it names, as written
    ids = li.tokenize(prompt)
    assert ids == tokenizer.encode(prompt).ids
    answer = list(li.generate(ids))
    assert text == tokenizer.decode(ids + answer) and len(answer) > 0
    logits = li.forward(ids, [None] * li.N_LAYERS, 0)                  # (L, vocab)
    assert li.sample(logits[-1]).item() == mx.argmax(logits[-1]).item()
    assert li.sample(logits).tolist() == mx.argmax(logits, axis=-1).tolist()
    assert li.sample(logits[-1], temperature=1e-30, top_p=0.5).item() == mx.argmax(logits[-1]).item()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("call, token", [(2, 1), (4, 3)])
def test_generation_stops_where_a_logit_stops_being_finite(checkpoint, tokenizer, monkeypatch,
                                                           call, token, bad):
    """One logit of one step NaN or inf (an overflow, made here by wrapping forward()): generate(),
    called from Python, raises FloatingPointError naming the token and the dtype, after yielding
    the ids before it. prefill() makes 2 calls for this prompt: the 2nd gives token 1's logits,
    then each token's call the next one's (the 4th: token 3's)."""
    li.load(checkpoint())
    ids = tokenizer.encode("The capital of France is").ids
    good = list(li.generate(ids, max_tokens=6))
    forward, calls = li.forward, []

    def overflowing(*args, **kwargs):
        calls.append(1)
        logits = forward(*args, **kwargs)                              # (L, vocab)
        if len(calls) != call:
            return logits
        return logits + mx.where(mx.arange(logits.shape[-1]) == 3, bad, 0.0)  # one logit a row

    monkeypatch.setattr(li, "forward", overflowing)
    shown = []
    with pytest.raises(FloatingPointError, match=rf"^the logits for token {token} are not finite "
                       r"\(NaN or inf\) in float32: the activations overflow it$"):
        for t in li.generate(ids, max_tokens=6):
            shown.append(t)
    assert shown == good[:token - 1]


def test_rms_norm_uses_the_eps_it_is_given(checkpoint):
    """rms_norm is compiled, and a trace keeps the Python values it read: called directly with
    an eps other than the loaded model's (1e-6), it must use that eps."""
    li.load(checkpoint())
    x = mx.array(np.random.default_rng(0).normal(0, 0.01, (3, 64)).astype(np.float32))
    w = mx.ones(64)
    for eps in (1e-6, 1e-2, 1e-6):
        expected = x / mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
        assert rel_err(li.rms_norm(x, w, eps), expected) < 1e-6


def test_tokenizer_with_an_id_equal_to_vocab_size(checkpoint, tokenizer):
    """ids are 0..vocab_size-1: a largest id equal to vocab_size is one past the table."""
    top = tokenizer.get_vocab_size(with_added_tokens=True) - 1
    with pytest.raises(li.UserError, match=f"has ids up to {top}, past the {top} rows"):
        li.load_checked(checkpoint(vocab_size=top))
    li.load_checked(checkpoint(vocab_size=top + 1))
