"""MLX's quantised checkpoints (issue 22): the written-out dequantize() against mx.dequantize, the
quantised product against the written-out one, and whole models against mlx-lm on folders that
mlx-lm's own convert() quantised (4 and 8 bits, groups of 64 and 128, tied and untied heads, and
a mixed folder: an 8-bit embedding under a tied head, one layer left in bfloat16, one at 8 bits).
"""
import json
import math
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.convert import convert

import llm_inference as li
from test_cli_errors import assert_error, run_cli, save_weights
from test_model import (TEXT, assert_generate_agrees, greedy_along_mlx_lm, mlx_lm_greedy,
                        mlx_lm_logits, rel_err)

WIDE = dict(hidden_size=128, intermediate_size=384)  # every input width a multiple of 128


def mixed(path, module):
    """mlx-lm's quant_predicate: the embedding at 8 bits (a tied head must use its bits, not the
    folder's 4), one layer's down_proj left unquantised, one o_proj at 8 bits in groups of 32."""
    if path == "model.embed_tokens":
        return {"group_size": 128, "bits": 8}
    if path == "model.layers.1.mlp.down_proj":
        return False
    if path == "model.layers.2.self_attn.o_proj":
        return {"group_size": 32, "bits": 8}
    return True


VARIANTS = {"4bit-g64-untied": (4, 64, "untied", None), "4bit-g128-tied": (4, 128, "tied", None),
            "8bit-g64-tied": (8, 64, "tied", None), "8bit-g128-untied": (8, 128, "untied", None),
            "mixed-tied": (4, 64, "tied", mixed)}


@pytest.fixture(scope="module")
def quantized(checkpoint, tmp_path_factory):
    """variant name -> a folder quantised by mlx_lm.convert from a bfloat16 checkpoint."""
    made = {}

    def make(name):
        if name not in made:
            bits, group, head, predicate = VARIANTS[name]
            source = checkpoint(dtype="bfloat16", lm_head=head, **WIDE)
            made[name] = tmp_path_factory.mktemp("quantized") / name
            convert(str(source), str(made[name]), quantize=True, q_group_size=group, q_bits=bits,
                    quant_predicate=predicate)
        return made[name]
    return make


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_dequantize_is_mx_dequantize(dtype):
    """Every width MLX's affine mode writes (3, 5 and 6 bits straddle bytes), every group size,
    every float dtype of the scales. Bit for bit what MLX's GPU kernels compute (since MLX 0.32.1:
    scale * q + bias in float32, then the scales' dtype), which mx.dequantize gives on any device
    for float32 scales, cast after. Against mx.dequantize on the scales as they are (a CPU adds in
    their dtype, a product and a sum each rounded): within one rounding of that dtype, relative to
    the terms (scale * q and bias may cancel): 2^-7 for bfloat16, 2^-10 for float16, 0 for
    float32 -- a claim that holds on the CPU and the GPU alike."""
    rng = np.random.default_rng(0)
    w = mx.array(rng.normal(0, 0.05, (48, 384)).astype(np.float32)).astype(dtype)
    ulp = {mx.float32: 0.0, mx.float16: 2.0 ** -10, mx.bfloat16: 2.0 ** -7}[dtype]
    for bits in (2, 3, 4, 5, 6, 8):
        for group in (32, 64, 128):
            packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
            ours = li.dequantize(packed, scales, biases, bits)
            assert ours.dtype == dtype and ours.shape == w.shape
            f32 = mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32),
                                group_size=group, bits=bits)           # float32 throughout
            assert mx.array_equal(ours, f32.astype(dtype)).item(), (bits, group)
            native = mx.dequantize(packed, scales, biases, group_size=group, bits=bits)
            terms = mx.abs(f32 - mx.repeat(biases, group, axis=-1)) + \
                mx.abs(mx.repeat(biases, group, axis=-1)).astype(mx.float32)  # |scale q| + |bias|
            err = mx.abs(ours.astype(mx.float32) - native.astype(mx.float32))
            assert (err <= ulp * terms).all().item(), (bits, group)


@pytest.mark.parametrize("bits, group", [(4, 64), (8, 128), (3, 32)])
def test_quantized_product_is_the_written_out_one(bits, group):
    """mx.quantized_matmul(x, packed) never writes the unpacked matrix; it must compute
    x @ dequantize(packed).T. float32: equal to float32's rounding (measured: identical here).
    bfloat16, each against the float32 answer: the written-out form rounds three times (3 x 2^-8
    at most; measured 2.3e-3). The fused kernel of this CPU sums its K = 384 products in bfloat16,
    a random walk of K roundings: up to 2^-8 sqrt(K) = 0.077 (measured 0.03-0.05: 15-20 times the
    written-out form's; a GPU's kernel sums in float32)."""
    rng = np.random.default_rng(1)
    w = mx.array(rng.normal(0, 0.05, (256, 384)).astype(np.float32))
    x = mx.array(rng.normal(0, 1, (7, 384)).astype(np.float32))
    packed, scales32, biases32 = mx.quantize(w, group_size=group, bits=bits)
    exact = x @ li.dequantize(packed, scales32, biases32, bits).T
    fused = mx.quantized_matmul(x, packed, scales32, biases32, group_size=group, bits=bits)
    assert rel_err(fused, exact) < 1e-6
    scales, biases, x16 = scales32.astype(mx.bfloat16), biases32.astype(mx.bfloat16), x.astype(mx.bfloat16)
    exact = x16.astype(mx.float32) @ li.dequantize(packed, scales, biases, bits).astype(mx.float32).T
    written = x16 @ li.dequantize(packed, scales, biases, bits).T
    fused = mx.quantized_matmul(x16, packed, scales, biases, group_size=group, bits=bits)
    print(f"bfloat16 {bits}-bit: written-out {rel_err(written, exact):.2e}, fused {rel_err(fused, exact):.2e}")
    assert rel_err(written, exact) <= 3 * 2 ** -8
    assert rel_err(fused, exact) <= 2 ** -8 * math.sqrt(x.shape[-1])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_mlx_lm(quantized, tokenizer, variant):
    """The same folder in both. float32 (the weights stay packed, the scales and the rest run in
    float32): within 1e-4, as unquantised (measured ~1e-6). bfloat16: no further from that float32
    answer than twice mlx-lm's own bfloat16 error (measured: about 0.04 each)."""
    folder = quantized(variant)
    ids = tokenizer.encode(TEXT).ids
    li.load(folder, mx.float32)
    ours = li.forward(ids, [None] * li.N_LAYERS, 0)
    exact = mlx_lm_logits(folder, ids, dtype=mx.float32)
    assert ours.dtype == mx.float32 and rel_err(ours, exact) < 1e-4
    li.load(folder)
    ours, ref = li.forward(ids, [None] * li.N_LAYERS, 0), mlx_lm_logits(folder, ids)
    assert ours.dtype == ref.dtype == mx.bfloat16
    print(f"{variant}: bfloat16 error ours {rel_err(ours, exact):.2e}, mlx-lm {rel_err(ref, exact):.2e}")
    assert rel_err(ours, exact) <= 2 * rel_err(ref, exact)


def test_the_folders_are_what_they_claim(quantized):
    """The fixtures are what their names say: packed uint32 weights, the tied head with no tensors
    of its own, the mixed folder's unquantised layer and its 8-bit ones."""
    w = mx.load(str(quantized("mixed-tied") / "model.safetensors"))
    assert w["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    assert w["model.layers.0.mlp.up_proj.weight"].shape == (384, 128 * 4 // 32)
    assert w["model.embed_tokens.weight"].shape == (640, 128 * 8 // 32) and "lm_head.weight" not in w
    assert w["model.layers.1.mlp.down_proj.weight"].dtype == mx.bfloat16
    assert "model.layers.1.mlp.down_proj.scales" not in w
    assert w["model.layers.2.self_attn.o_proj.scales"].shape == (128, 128 // 32)
    cfg = json.loads((quantized("mixed-tied") / "config.json").read_text())["quantization"]
    assert cfg["model.layers.2.self_attn.o_proj"] == {"group_size": 32, "bits": 8}
    assert "model.layers.1.mlp.down_proj" not in cfg  # a layer left unquantised has no entry


@pytest.mark.parametrize("variant", ["4bit-g64-untied", "mixed-tied"])
def test_greedy_equals_mlx_lm(quantized, tokenizer, variant):
    """Teacher-forced along mlx-lm's greedy ids, in float32 (tests/test_model.py's method)."""
    folder = quantized(variant)
    ids = tokenizer.encode("The capital of France is").ids
    ref, top2s, ref_logits = mlx_lm_greedy(folder, ids, 20, mx.float32)
    li.load(folder, mx.float32)
    agreed = greedy_along_mlx_lm(ids, ref, top2s, ref_logits)
    assert_generate_agrees(ids, 20, ref, agreed)


def test_prefill_and_decode_equal_one_forward(quantized, tokenizer):
    li.load(quantized("mixed-tied"))
    ids = tokenizer.encode(TEXT).ids
    full = li.forward(ids, [None] * li.N_LAYERS, 0)
    cache = [None] * li.N_LAYERS
    rows = [li.forward(ids[:9], cache, 0)] + [li.forward([t], cache, p) for p, t in enumerate(ids[9:], 9)]
    assert rel_err(mx.concatenate(rows), full) < 1e-2  # bfloat16: the same operations, other shapes
    li.load(quantized("mixed-tied"), mx.float32)
    full = li.forward(ids, [None] * li.N_LAYERS, 0)
    cache = [None] * li.N_LAYERS
    rows = [li.forward(ids[:9], cache, 0)] + [li.forward([t], cache, p) for p, t in enumerate(ids[9:], 9)]
    assert rel_err(mx.concatenate(rows), full) < 1e-5


def test_embedding_unpacks_only_the_rows_it_picks(quantized):
    li.load(quantized("mixed-tied"))
    ids = [5, 77, 5, 639]
    table = mx.dequantize(li.W["model.embed_tokens.weight"],                # float32, then cast:
                          li.W["model.embed_tokens.scales"].astype(mx.float32),  # dequantize()'s
                          li.W["model.embed_tokens.biases"].astype(mx.float32), group_size=128,
                          bits=8).astype(li.W["model.embed_tokens.scales"].dtype)
    assert mx.array_equal(li.embed(ids), table[mx.array(ids)]).item()
    assert li.W["lm_head.weight"] is li.W["model.embed_tokens.weight"]  # tied: the same packed table


@pytest.mark.parametrize("variant", ["4bit-g64-untied", "8bit-g128-untied", "mixed-tied"])
def test_command_line(quantized, variant):
    folder = quantized(variant)
    bits, group = VARIANTS[variant][:2]
    r = run_cli("--model", str(folder), "-m", "4")
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert f", {bits}-bit, groups of {group}: " in first and first.endswith(" GB, bfloat16")
    assert "Generation: 4 tokens" in r.stdout
    r = run_cli("--model", str(folder), "-m", "4", "--dtype", "float32")  # the fast way on a CPU
    assert r.returncode == 0 and r.stdout.splitlines()[0].endswith(" GB, float32"), r.stderr


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
def test_other_quantisation_modes_are_refused(quantized, tmp_path, mode):
    folder = Path(shutil.copytree(quantized("4bit-g64-untied"), tmp_path / mode))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"] = cfg["quantization_config"] = {"group_size": 32, "bits": 4, "mode": mode}
    (folder / "config.json").write_text(json.dumps(cfg))
    r = run_cli("--model", str(folder))
    assert_error(r, f"{folder / 'config.json'}: quantization must be MLX's affine quantisation (not "
                 f'"mxfp4", "nvfp4" or "mxfp8"), not {{"group_size": 32, "bits": 4, "mode": "{mode}"}}')
    assert r.stdout == ""


def test_a_packing_that_does_not_fit_the_config(quantized, tmp_path):
    folder = Path(shutil.copytree(quantized("4bit-g64-untied"), tmp_path / "m"))
    w = mx.load(str(folder / "model.safetensors"))
    w["model.layers.0.mlp.up_proj.weight"] = w["model.layers.0.mlp.up_proj.weight"][:, :14]
    save_weights(folder / "model.safetensors", w, metadata={"format": "mlx"})
    assert_error(run_cli("--model", str(folder)), "tensor model.layers.0.mlp.up_proj.weight in",
                 "(384, 14) packed with scales (384, 2) is not MLX's quantisation of (384, 128)")


def test_quantised_weights_take_fewer_bytes(quantized, checkpoint):
    """What quantising is for: the 4-bit folder's weights in memory against its bfloat16 source."""
    li.load(checkpoint(dtype="bfloat16", lm_head="untied", **WIDE))
    dense = sum(w.nbytes for w in li.W.values())
    li.load(quantized("4bit-g64-untied"))
    packed = sum(w.nbytes for w in li.W.values())
    # 4 bits and a bfloat16 scale and bias per 64 numbers: 4.5 bits against 16 (the norms stay)
    assert packed < dense * 0.35 and math.isclose(packed / dense, 4.5 / 16, rel_tol=0.15)


# ═══ dequantize() as the Apple GPU kernels compute it since MLX 0.32.1 (issue item 6) ═══
def unpack(packed, bits):
    """Packed uint32 rows -> their bits-bit integers (numpy int64): each row a little-endian
    stream of bits, read here bit by bit with numpy, apart from dequantize()'s byte pairs."""
    stream = np.unpackbits(np.array(packed).view(np.uint8), axis=-1, bitorder="little")
    stream = stream.reshape(*packed.shape[:-1], -1, bits).astype(np.int64)  # (..., n, bits)
    return (stream << np.arange(bits)).sum(-1)                        # (..., n)


def pack(q, bits):
    """The inverse, for hand-made tensors: integers (..., n) -> uint32 rows."""
    stream = ((q[..., None] >> np.arange(bits)) & 1).astype(np.uint8)
    stream = np.packbits(stream.reshape(*q.shape[:-1], -1), axis=-1, bitorder="little")
    return mx.array(stream.view(np.uint32))


def float32_then_cast(q, scales, biases):
    """scale * q + bias in float32, then cast to the scales' dtype. For bfloat16 and float16
    scales the float32 arithmetic is exact or all but (their 8 or 11 significant bits times an
    integer under 2^8 fit float32's 24; the bias's add rounds at most once, by 2^-24): the cast is
    the one rounding. For float32 scales it is dequantize()'s own arithmetic, rounding included."""
    q = mx.array(q.astype(np.float32)).reshape(*scales.shape, -1)     # (..., groups, group)
    w = scales.astype(mx.float32)[..., None] * q + biases.astype(mx.float32)[..., None]
    return w.reshape(*w.shape[:-2], -1).astype(scales.dtype)


def hand_made(bits, dtype, rows=6, n=256, group=64, seed=3):
    """Integers of every value 0..2^bits - 1, scales of both signs, biases that often cancel
    scale * q (values near 0), packed by hand."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 2 ** bits, (rows, n))
    scales = rng.normal(0, 0.01, (rows, n // group)) * rng.choice([-1, 1], (rows, n // group))
    biases = -scales * rng.integers(0, 2 ** bits, scales.shape) + rng.normal(0, 1e-3, scales.shape)
    as_mx = lambda a: mx.array(a.astype(np.float32)).astype(dtype)  # noqa: E731
    return pack(q, bits), as_mx(scales), as_mx(biases), q


def quantised(bits, dtype, group=64):
    rng = np.random.default_rng(4)
    w = mx.array(rng.normal(0, 0.05, (32, 256)).astype(np.float32)).astype(dtype)
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    return packed, scales, biases, unpack(packed, bits)


UNIT_ROUNDOFF = {mx.bfloat16: 2.0 ** -8, mx.float16: 2.0 ** -11, mx.float32: 2.0 ** -24}


def dequantized(source, bits, dtype):
    """(source's tensors, ours, the formula's, mx.dequantize's in float32, the bound on the gap
    from mx.dequantize, as in test_dequantize_is_within_a_rounding_of_mx_dequantize)."""
    packed, scales, biases, q = (hand_made if source == "hand-made" else quantised)(bits, dtype)
    group = q.shape[-1] // scales.shape[-1]
    ones = mx.ones(scales.shape, mx.float32)  # scale 1, bias 0: MLX's own reading of the integers
    assert np.array_equal(np.array(mx.dequantize(packed, ones, 0 * ones, group_size=group,
                                                 bits=bits)), q)
    ours = li.dequantize(packed, scales, biases, bits)
    exact = float32_then_cast(q, scales, biases)
    assert ours.dtype == dtype and ours.shape == q.shape
    theirs = mx.dequantize(packed, scales, biases, group_size=group, bits=bits).astype(mx.float32)
    u = UNIT_ROUNDOFF[dtype]
    sq = mx.abs(scales.astype(mx.float32)[..., None] *
                mx.array(q.astype(np.float32)).reshape(*scales.shape, -1)).reshape(q.shape)
    bound = 2 * u * mx.abs(exact.astype(mx.float32)) + u * (1 + u) * sq
    return ours, exact, theirs, bound


DEQUANTIZED = [pytest.param(source, bits, dtype, id=f"{source}-{bits}bit-{name}")
               for source in ("hand-made", "mx.quantize") for bits in (3, 4, 8)
               for name, dtype in (("bfloat16", mx.bfloat16), ("float16", mx.float16),
                                   ("float32", mx.float32))]


@pytest.mark.parametrize("source, bits, dtype", DEQUANTIZED)
def test_dequantize_is_within_a_rounding_of_mx_dequantize(source, bits, dtype):
    """dequantize() and the float32-then-cast formula (test_dequantize_computes_in_float32_then_
    casts), against mx.dequantize on whatever device runs this (a hand-made packing whose biases
    cancel scale * q, and mx.quantize's of a matrix; the integers unpacked here with numpy, and
    checked against MLX's own reading). The Apple GPU's kernel is the formula (equal); a CPU's
    computes in the scales' dtype, r = fl(fl(s q) + b). With u the dtype's unit roundoff
    (bfloat16 2^-8, float16 2^-11) and w = s q + b exact: |fl(s q) - s q| <= u |s q|,
    |r - fl(s q) - b| <= u |w| + u^2 |s q|, and fl(w) is within u |w| of w, so
    |fl(w) - r| <= 2u |w| + u (1 + u) |s q|: one rounding step of the value (2u: the dtype's
    spacing, relative) plus the rounding of s q before the bias, which the add does not shrink
    where b cancels s q (values near 0: their relative error unbounded, the absolute one
    u |s q|). Measured on a CPU: the formula reaches 0.71 to 0.96 of this bound; today's
    dequantize() (scales-dtype arithmetic, as the CPU's) is equal to mx.dequantize there."""
    ours, exact, theirs, bound = dequantized(source, bits, dtype)
    gap = {name: mx.abs(w.astype(mx.float32) - theirs) for name, w in
           (("ours", ours), ("the formula", exact))}
    print(", ".join(f"{name} at most {(g / (bound + 1e-30)).max().item():.2f} of the bound"
                    for name, g in gap.items()))
    assert mx.all(gap["the formula"] <= bound).item()
    assert mx.all(gap["ours"] <= bound).item()


@pytest.mark.parametrize("source, bits, dtype", DEQUANTIZED)
def test_dequantize_computes_in_float32_then_casts(source, bits, dtype):
    """dequantize() as the Apple GPU kernels compute since MLX 0.32.1: scale * q + bias in
    float32, then one cast to the scales' dtype, bit for bit against that formula on the integers
    unpacked here with numpy. FAILS WITH TODAY'S dequantize() for bfloat16 and float16 (it
    computes in the scales' dtype: scale * q rounded, then + bias rounded again; measured: 20 to
    65% of the values differ, by one step or, near 0, more); float32 passes either way."""
    ours, exact, _, _ = dequantized(source, bits, dtype)
    assert mx.array_equal(ours, exact).item(), f"{(ours != exact).sum().item()} of {ours.size}"
