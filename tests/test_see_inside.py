"""See inside, further (issue 36): where the prompt's last token looks in each attention block, and
what a decoded token costs in bytes beside what the machine can move.

The attention weights are proven against mlx-lm's own modules on the same tiny float32
checkpoints: each block's input from mlx-lm's layers, its query and keys from that layer's
projections, norms and RoPE, softmax(q k^T * scale) over the prompt, averaged over heads."""
import os
import re
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

import llm_inference as li
from test_cli_errors import run_cli

PROMPT = "The capital of France is Paris. The capital of Japan is"


def reference_looks(folder, ids):
    """mlx-lm's layers, one after another -> {block number: the last token's attention weights
    over the prompt, (S,), averaged over heads}, for each full-attention layer."""
    model, _ = load_model(Path(folder))
    text = getattr(model, "language_model", model)
    x, looks = text.model.embed_tokens(mx.array(ids)[None]), {}
    L = len(ids)
    for i, layer in enumerate(text.model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and not getattr(layer, "is_linear", False):
            h = layer.input_layernorm(x)
            heads, kv = li.N_HEADS, li.N_KV
            q = attn.q_proj(h).reshape(1, L, heads, -1)
            if q.shape[-1] == 2 * li.D_HEAD:  # Qwen3.5: each head's query, then its gate
                q = q[..., :li.D_HEAD]
            q = attn.rope(attn.q_norm(q).transpose(0, 2, 1, 3))
            k = attn.rope(attn.k_norm(attn.k_proj(h).reshape(1, L, kv, -1)).transpose(0, 2, 1, 3))
            k = mx.repeat(k, heads // kv, axis=1)                      # (1, H, L, hd)
            scores = (q[:, :, -1:] @ k.swapaxes(-1, -2)) * attn.scale  # (1, H, 1, L)
            looks[i + 1] = mx.softmax(scores.astype(mx.float32), axis=-1)[0, :, 0].mean(axis=0)
        x = layer(x, "causal" if attn is not None else None, None)
    return looks


def ours(folder, ids):
    li.load(folder)
    cache, blocks = [None] * li.N_LAYERS, []
    li.prefill(ids, cache, 0, blocks)
    return dict(li.attention_looks(ids, blocks, cache))


@pytest.mark.parametrize("model", ["qwen3", "qwen35"])
def test_attention_weights_are_step_5s(checkpoint, qwen35, tokenizer, model):
    """float32: each full-attention block's weights equal mlx-lm's computation to float32's
    rounding (measured ~1e-7); they sum to 1; Qwen3.5's DeltaNet blocks have none."""
    folder = checkpoint() if model == "qwen3" else qwen35()
    ids = tokenizer.encode(PROMPT).ids
    mine, ref = ours(folder, ids), reference_looks(folder, ids)
    assert sorted(mine) == sorted(ref) == ([1, 2, 3] if model == "qwen3" else [4])
    for block, weights in mine.items():
        assert weights.shape == (len(ids),)
        assert mx.abs(weights - ref[block]).max().item() < 1e-5, block
        assert abs(weights.sum().item() - 1) < 1e-5


def test_explain_shows_where_the_last_token_looks(checkpoint):
    """--explain prints, per attention block, its three heaviest earlier tokens with bars and the
    rest's weight: the four sum to 1 (as printed, to 4 digits); the figures are attention_looks'."""
    folder = str(checkpoint())
    li.load(folder)
    r = run_cli("--model", folder, "-p", PROMPT, "-m", "2", "--explain")
    assert r.returncode == 0, r.stderr
    section = r.stdout.split("where the last token looks")[1].split("==========")[0]
    rows = re.findall(r"block (\d+) +(.*)\n((?:.*\n){2})\s+rest +([\d.]+)", section)
    assert [int(b) for b, *_ in rows] == list(range(1, li.N_LAYERS + 1))
    for _, first, others, rest in rows:
        weights = [float(w) for w in re.findall(r"(\d\.\d+|\d(?:e-\d+)?)\s*█*$", first + "\n" +
                                                others, re.M)]
        assert len(weights) == 3 and abs(sum(weights) + float(rest) - 1) < 2e-3, (weights, rest)


def test_bytes_per_token_are_the_arrays_nbytes(checkpoint):
    """The statistics' bytes per decoded token: every weight a token reads (the embedding's one
    row aside, unless the LM head reads the same table) and the KV cache at the length reached,
    each the arrays' own nbytes; the rate is bytes x tokens-per-sec."""
    folder = str(checkpoint())
    li.load(folder)
    cache = [None] * li.N_LAYERS
    ids = li.tokenize(PROMPT)
    out = list(li.generate(ids, max_tokens=4, cache=cache))
    held = len(ids) + len(out)
    weights = sum(w.nbytes for name, w in li.W.items() if not name.startswith("model.embed"))
    kv = sum(k[:, :held].nbytes + v[:, :held].nbytes for k, v in cache)
    assert li.token_bytes(cache, held) == (weights, kv)
    r = run_cli("--model", folder, "-p", PROMPT, "-m", "4")
    line = re.search(r"Bytes per token: ([\d.]+) MB of weights \+ ([\d.]+) MB of cache, "
                     r"([\d.]+) GB/s at ([\d.]+) tokens-per-sec", r.stdout)
    assert line, r.stdout
    w_mb, c_mb, rate, tps = (float(g) for g in line.groups())
    assert w_mb == pytest.approx(weights / 1e6, abs=1e-3)
    assert rate == pytest.approx((w_mb + c_mb) * 1e6 * tps / 1e9, rel=2e-3, abs=1e-3)


def test_bandwidth_counts_the_bytes_read_the_best_of_several(monkeypatch):
    """What bandwidth() counts and how, with no timing: size bytes over the fastest of its tries
    (a fake clock gives each try its duration; the fastest here is the second, not the last),
    each try reading a buffer of size bytes that was written before the clock first ran (no page
    faults timed). On the CPU, whose MLX runs an operation on one core, each core reads its part
    on a stream of its own, so that the probe reads as fast as the machine does."""
    events, ticks = [], iter([0, 0.5, 1, 1.2, 2, 2.4, 3, 3.3, 4, 4.6, 5, 5.25])
    real_eval = mx.eval

    def clock():
        events.append("clock")
        return next(ticks)

    def evaluate(*arrays):
        events.append([a.nbytes for x in arrays for a in (x if isinstance(x, list) else [x])])
        return real_eval(*arrays)

    monkeypatch.setattr(li, "time", type("FakeTime", (), {"perf_counter": staticmethod(clock)}))
    monkeypatch.setattr(mx, "eval", evaluate)
    assert li.bandwidth(size=2**20, tries=6) == pytest.approx(2**20 / 0.2)  # 1.2 - 1
    parts = len(os.sched_getaffinity(0)) if mx.default_device() == mx.cpu else 1
    assert sum(events[0]) == 2**20 and len(events[0]) == parts, "written first, outside the timing"
    assert events[1:] == ["clock", [4] * parts, "clock"] * 6  # each try: one read of each part
    if mx.default_device() == mx.cpu:
        assert len(set(map(str, li.cpu_streams(parts)))) == parts  # a stream a core
    monkeypatch.undo()
    assert li.bandwidth(size=2**20, tries=2) > 0


def test_explain_says_what_share_of_the_bandwidth_decoding_read(checkpoint):
    r = run_cli("--model", str(checkpoint()), "-p", PROMPT, "-m", "4", "--explain")
    line = re.search(r"this machine reads ([\d.]+) GB/s \(268 MB already in memory, the best of 5\)"
                     r": decoding read ([\d.]+)% of it", r.stdout)
    rate = re.search(r"Bytes per token: .*, ([\d.]+) GB/s at", r.stdout)
    assert line and rate, r.stdout
    speed, share = float(line[1]), float(line[2])
    assert share == pytest.approx(100 * float(rate[1]) / speed, rel=0.02, abs=0.05)


def test_where_the_last_token_looks_takes_memory_linear_in_the_prompt(checkpoint, tokenizer):
    """attention_looks() over a 2,000-token prompt: the memory it adds (peak over what the model
    and cache hold) stays within a bound linear in S: a few arrays of S per head, not S x S."""
    li.load(checkpoint())
    ids = (tokenizer.encode(PROMPT).ids * 200)[:2000]
    cache, blocks = [None] * li.N_LAYERS, []
    li.prefill(ids, cache, 0, blocks)
    mx.eval(cache, blocks)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    looks = li.attention_looks(ids, blocks, cache)
    mx.eval([w for _, w in looks])
    added = mx.get_peak_memory() - base
    S = len(ids)
    assert added < 64 * S * li.N_HEADS * 4, added  # S x S float32 would be 16 MB a block


def test_qwen35_names_the_blocks_without_weights(qwen35):
    """Qwen3.5: its one attention block shows its weights, its DeltaNet blocks are named."""
    r = run_cli("--model", str(qwen35()), "-p", PROMPT, "-m", "2", "--explain")
    section = r.stdout.split("where the last token looks")[1].split("==========")[0]
    assert "\n   block 4 " in section and "block 1 " not in section, section
    assert "blocks 1, 2, 3: Gated DeltaNet, compressed notes: no such weights" in section
