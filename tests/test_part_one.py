"""Part I stands alone: its source, from the top of llm_inference.py to Part II's banner, executed
by itself in a fresh interpreter (as a notebook cell would run it), loads a dense Qwen3 folder and
produces exactly the tokens the whole file produces through the command line's checked loading."""
import json
import re
import shutil
import subprocess
from functools import partial
from pathlib import Path
import sys

import mlx.core as mx
import pytest

import llm_inference as li
from test_cli_errors import save_weights

PROMPT = "The capital of France is"
# Runs in a fresh interpreter: Part I's text alone, then the article's calls on it.
DRIVER = r"""
import json, sys
source = open(sys.argv[1], encoding="utf-8").read()
part_one = source[:source.index("\n# ═══ Part II")]
names = {"__name__": "__main__"}
exec(compile(part_one, "part_one", "exec"), names)
folder, dtype, prompt = sys.argv[2], sys.argv[3], sys.argv[4]
mx = names["mx"]
names["load"](folder, getattr(mx, dtype) if dtype != "none" else None)
tokenize, generate = names["tokenize"], names["generate"]
greedy = list(generate(tokenize(prompt), max_tokens=12))
mx.random.seed(7)
sampler = names["partial"](names["sample"], temperature=1.0, top_p=0.9)
sampled = list(generate(tokenize(prompt), max_tokens=12, sampler=sampler))
x = mx.ones((2, names["D"]))
print(json.dumps({"greedy": greedy, "sampled": sampled, "text": names["TOK"].decode(greedy),
                  "rms_norm": names["rms_norm"](x, mx.ones(names["D"])).tolist()[0][:2],
                  "sample": names["sample"](mx.array([0.0, 1.0, 3.0])).item()}))
"""


def part_one_alone(folder, dtype):
    out = subprocess.run([sys.executable, "-c", DRIVER, li.__file__, str(folder), dtype, PROMPT],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("options, dtype", [({}, "none"), ({"lm_head": "tied"}, "none"),
                                            ({"dtype": "bfloat16", "lm_head": "tied_stored"},
                                             "none"),
                                            ({"dtype": "bfloat16", "shards": 2}, "float32")])
def test_part_one_alone_gives_the_whole_files_tokens(checkpoint, options, dtype):
    folder = checkpoint(**options)
    alone = part_one_alone(folder, dtype)
    li.load_checked(folder, None if dtype == "none" else getattr(mx, dtype))  # Part IV's loading
    ids = li.tokenize(PROMPT)
    assert alone["greedy"] == list(li.generate(ids, max_tokens=12)) and len(alone["greedy"]) > 0
    mx.random.seed(7)
    sampler = partial(li.sample, temperature=1.0, top_p=0.9)
    assert alone["sampled"] == list(li.generate(ids, max_tokens=12, sampler=sampler))
    assert alone["text"] == li.TOK.decode(alone["greedy"])
    assert alone["rms_norm"] == pytest.approx([1.0, 1.0], abs=1e-5)  # the article's rms_norm(x, w)
    assert alone["sample"] == 2                                      # and its sample(logits)


def test_part_one_is_what_its_banner_says():
    """The four banners stand, in order; Part I defines the constants with Qwen3-0.6B's values."""
    lines = open(li.__file__, encoding="utf-8").read().splitlines()
    banners = [i for i, line in enumerate(lines) if line.startswith("# ═══ Part ")]
    assert [lines[i].split()[3] for i in banners] == ["I", "II", "III", "IV"]
    fresh = {}
    exec(compile("\n".join(lines[:banners[1]]), "part_one", "exec"), fresh)
    assert (fresh["D"], fresh["N_LAYERS"], fresh["N_HEADS"], fresh["N_KV"], fresh["D_HEAD"]) == \
        (1024, 28, 16, 8, 128)
    assert (fresh["EPS"], fresh["THETA"], fresh["MAX_POS"]) == (1e-6, 1e6, 40960)


def test_the_articles_apply_rope_call_says_ours_for_its_layout(checkpoint):
    """The article's call, apply_rope(q, k, positions), on its heads-first q (16, L, 128): a
    TypeError whose hint, run as written, turns q as the article's rotate() does. With as many
    positions as heads (16 on 0.6B), a positions-first call on that q broadcasts without an error
    and turns it wrongly: the hint must not lead there."""
    li.load(checkpoint())
    L, half = li.N_HEADS, li.D_HEAD // 2
    q = mx.random.normal((li.N_HEADS, L, li.D_HEAD), key=mx.random.key(1))  # heads first
    positions = list(range(5, 5 + L))
    with pytest.raises(TypeError) as raised:
        li.apply_rope(q, q, mx.array(positions))
    hint = str(raised.value).rsplit(": ", 1)[1]
    names = dict(apply_rope=li.apply_rope, rope_tables=li.rope_tables, mx=mx, q=q,
                 positions=positions)
    freqs = 1.0 / (li.THETA ** (mx.arange(half, dtype=mx.float32) / half))  # the article's
    angles = mx.array(positions, dtype=mx.float32)[:, None] * freqs[None, :]
    cos, sin = mx.cos(angles)[None, :, :], mx.sin(angles)[None, :, :]
    x1, x2 = q[..., :half], q[..., half:]
    rotated = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    assert mx.allclose(eval(hint, names), rotated, atol=1e-5)
    unturned = li.apply_rope(q, *li.rope_tables(mx.array(positions), q.dtype))  # runs, wrongly
    assert not mx.allclose(unturned, rotated, atol=1e-2)


@pytest.fixture
def four_files(checkpoint, tokenizer, tmp_path):
    """The article's four files only (no generation_config.json), config.json's eos_token_id
    <|endoftext|> alone, as a base model's; lm_head's <|im_end|> row made to point along the
    last hidden state of PROMPT, so that the greedy answer's first token is <|im_end|>."""
    folder = Path(shutil.copytree(checkpoint(), tmp_path / "four"))
    (folder / "generation_config.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = tokenizer.token_to_id("<|endoftext|>")
    (folder / "config.json").write_text(json.dumps(config))
    li.load_checked(folder)
    blocks = []
    li.forward(li.tokenize(PROMPT), [None] * li.N_LAYERS, 0, blocks)
    h = li.rms_norm(blocks[-1][-1], li.W["model.norm.weight"], li.EPS)  # (D,) what lm_head reads
    weights = mx.load(str(folder / "model.safetensors"))
    weights["lm_head.weight"][tokenizer.token_to_id("<|im_end|>")] = 10 * h
    save_weights(folder / "model.safetensors", weights, metadata={"format": "pt"})
    assert sorted(f.name for f in folder.iterdir()) == ["config.json", "model.safetensors",
                                                        "tokenizer.json", "tokenizer_config.json"]
    return folder


def test_part_one_and_the_full_loader_agree_on_eos(four_files, tokenizer):
    """Without generation_config.json, Qwen3's two EOS ids come from the tokenizer: Part I's load()
    and Part IV's load_checked() both stop on <|im_end|> and <|endoftext|>, though config.json
    names only the second. The greedy answer here would open with <|im_end|>: no token at all,
    in the whole file and in Part I alone."""
    im_end, endoftext = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    ids = li.tokenize(PROMPT)
    for loader in (li.load, li.load_checked):
        loader(four_files)
        assert {im_end, endoftext} <= set(li.EOS_IDS), (loader.__name__, li.EOS_IDS)
        assert mx.argmax(li.prefill(ids, [None] * li.N_LAYERS)).item() == im_end  # greedy's choice
        assert list(li.generate(ids, max_tokens=12)) == [], loader.__name__
    assert part_one_alone(four_files, "none")["greedy"] == []


def test_attend_is_one_sequences(checkpoint):
    """Step 5's attend() on one sequence's shapes, as the article has it (no batch axis): q (L, H,
    hd), keys and values (KV, S, hd), the mask (L, S) -> (L, H * hd), equal in float32 to MLX's
    fused attention (mx.fast, a reference only) with the same mask, to float32's rounding."""
    li.load(checkpoint())
    L, S, H, KV, hd = 3, 7, li.N_HEADS, li.N_KV, li.D_HEAD
    q = mx.random.normal((L, H, hd), key=mx.random.key(0))
    k, v = (mx.random.normal((KV, S, hd), key=mx.random.key(i)) for i in (1, 2))
    visible = mx.arange(S)[None, :] <= mx.arange(S - L, S)[:, None]   # a chunk after 4 cached
    out = li.attend(q, k, v, visible)
    assert out.shape == (L, H * hd)
    ref = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], k[None], v[None],
                                               scale=hd ** -0.5, mask=visible)  # (1, H, L, hd)
    assert mx.abs(out - ref[0].transpose(1, 0, 2).reshape(L, -1)).max().item() < 1e-5


def test_part_one_copied_out_runs_the_articles_script(checkpoint, tmp_path):
    """Part I alone, saved as llm_inference.py beside a Qwen3-0.6B folder and run as a script from
    there, prints what the article's run prints: the model's line, the prompt, a rule, the prompt
    with its completion (the whole file's greedy tokens, 100 at most), the time. The whole file,
    run the same way, runs main() instead: the article's lines are not its own."""
    source = open(li.__file__, encoding="utf-8").read()
    (tmp_path / "llm_inference.py").write_text(source[:source.index("\n# ═══ Part II")] + "\n")
    shutil.copytree(checkpoint(), tmp_path / "Qwen3-0.6B")
    out = subprocess.run([sys.executable, "llm_inference.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    li.load_checked(tmp_path / "Qwen3-0.6B")
    ids = li.tokenize(PROMPT)
    head = (f"Model: Qwen3-0.6B ({li.N_LAYERS} layers, {li.D} dim, {li.N_HEADS} Q heads, "
            f"{li.N_KV} KV heads)\nPrompt: {PROMPT}\n{'-' * 60}\nOutput: ")
    text = li.TOK.decode(ids + list(li.generate(ids)))  # (random weights: any characters)
    assert out.stdout.startswith(head + text + "\nTime: "), out.stdout[:200]
    assert re.fullmatch(r"\d+\.\d\ds\n", out.stdout[len(head + text + "\nTime: "):])
    whole = subprocess.run([sys.executable, li.__file__, "--model", str(tmp_path / "Qwen3-0.6B"),
                            "-m", "2", "-q"], capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0 and "Model:" not in whole.stdout, whole.stderr


def test_generate_refuses_text_at_the_call(checkpoint):
    """The article's generate() takes text; this one takes ids, and says so when called with text,
    before anything is iterated."""
    li.load(checkpoint())
    with pytest.raises(TypeError, match="generate\\(\\) takes ids"):
        li.generate(PROMPT)


@pytest.mark.parametrize("scaling", [{"rope_type": "default"}, {}, {"type": "default"}])
def test_part_one_alone_reads_a_plain_rope_said_so(checkpoint, tmp_path, scaling):
    """A rope_scaling that names the plain RoPE (or none at all) is plain Qwen3: Part I alone
    loads it itself, never reaching for load_checked() (which a copy of Part I lacks), and gives
    the whole file's tokens."""
    folder = Path(shutil.copytree(checkpoint(), tmp_path / "plain"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
    alone = part_one_alone(folder, "none")
    li.load_checked(folder)
    assert alone["greedy"] == list(li.generate(li.tokenize(PROMPT), max_tokens=12))
