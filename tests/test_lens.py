"""Issue 44: --explain's picture of the answer forming, the logit lens over every generated token:
a row per block, a column per answer token, each cell that block's likeliest next token, shaded by
the probability it gives the token written."""
import io
import os
import pty
import re
import select
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.utils import load_model

import llm_inference as li
from conftest import build_tokenizer
from test_cli_errors import ROOT, assert_error, run_cli
from test_quantized import quantized  # noqa: F401 (a fixture)

PROMPT = "The capital of France is"
SHADES = "▁▂▃▄▅▆▇█"


def lens_of(ids, n, cache=None, start=0):
    """Greedy: n ids after ids, then logit_lens() over them -> (answer, top, p) as lists."""
    cache = [None] * li.N_LAYERS if cache is None else cache
    answer = list(li.generate(ids, n, cache=list(cache), start=start))
    top, p, _ = li.logit_lens(ids + answer[:-1], answer, cache, start)
    return answer, top.tolist(), p.tolist()


def by_hand(token_ids, written):
    """Each block's output at the last len(written) positions, through lm_head() -> top, p."""
    blocks = []
    li.forward(token_ids, [None] * li.N_LAYERS, 0, blocks)
    top, p = [], []
    for x in blocks:
        probs = mx.softmax(li.lm_head(x[len(token_ids) - len(written):]).astype(mx.float32), axis=-1)
        top.append(mx.argmax(probs, axis=-1).tolist())
        p.append(mx.take_along_axis(probs, mx.array(written)[:, None], axis=-1)[:, 0].tolist())
    return top, p


# ─── What the cells hold ───

@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
def test_top_row_is_the_greedy_answer_in_float32(kind, checkpoint, qwen35, tokenizer):
    li.load(checkpoint(init="wide") if kind == "qwen3" else qwen35(tied=False))
    ids = tokenizer.encode(PROMPT).ids
    answer, top, _ = lens_of(ids, 24)
    assert len(answer) == 24 and len(top) == li.N_LAYERS and top[-1] == answer
    assert any(row != answer for row in top[:-1])  # the blocks below differ: a real picture


@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
def test_each_cell_is_lm_head_of_that_blocks_output(kind, checkpoint, qwen35, tokenizer):
    """A cell: argmax of lm_head(x after block b) at that position, and softmax's value at the
    token written; lm_head() recomputes the final RMSNorm on that block's own x."""
    li.load(checkpoint(init="realistic", num_hidden_layers=4) if kind == "qwen3" else qwen35(tied=False))
    ids = tokenizer.encode("Once upon a time 😀").ids
    answer, top, p = lens_of(ids, 10)
    ref_top, ref_p = by_hand(ids + answer[:-1], answer)
    assert top == ref_top
    assert np.allclose(p, ref_p, atol=1e-5)
    norm = li.W["model.norm.weight"]
    for b in range(li.N_LAYERS):  # by hand: the block's own mean square, not the last block's
        blocks = []
        li.forward(ids + answer[:-1], [None] * li.N_LAYERS, 0, blocks)
        x = blocks[b][len(ids) - 1:].astype(mx.float32)
        x = x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + li.EPS) * norm
        assert mx.argmax(x @ li.W["lm_head.weight"].T, axis=-1).tolist() == top[b]


@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
def test_cells_against_mlx_lms_own_modules(kind, checkpoint, qwen35, tokenizer):
    """mlx-lm's layers (Qwen3's; Qwen3.5's DeltaNet and attention blocks) give the hidden states
    after each block; its norm and LM head give the lens: the same tokens and probabilities."""
    folder = checkpoint(init="wide", lm_head="tied_stored") if kind == "qwen3" else qwen35(tied=False)
    li.load(folder)
    ids = tokenizer.encode(PROMPT).ids
    answer, top, p = lens_of(ids, 12)
    model, _ = load_model(Path(folder))
    text = model if kind == "qwen3" else model.language_model
    head = text.lm_head if kind == "qwen35" else text.model.embed_tokens.as_linear
    h = text.model.embed_tokens(mx.array(ids + answer[:-1])[None])
    mask = create_attention_mask(h, None)  # causal; a DeltaNet block takes none
    for b, layer in enumerate(text.model.layers):
        h = layer(h, None if getattr(layer, "is_linear", False) else mask, None)
        probs = mx.softmax(head(text.model.norm(h))[0, len(ids) - 1:].astype(mx.float32), axis=-1)
        assert mx.argmax(probs, axis=-1).tolist() == top[b]
        ref = mx.take_along_axis(probs, mx.array(answer)[:, None], axis=-1)[:, 0]
        assert np.allclose(p[b], ref.tolist(), atol=1e-5)
    assert b == li.N_LAYERS - 1 and (kind == "qwen3" or any(map(li.deltanet, range(b))))


@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
def test_in_chunks_and_after_a_cache_as_in_one_pass(kind, checkpoint, qwen35, tokenizer, monkeypatch):
    """A pass of several chunks (the columns begin inside one), going on from a cache that holds
    earlier text (a chat's next turn), gives what one pass over everything from 0 gives."""
    li.load(checkpoint(init="wide") if kind == "qwen3" else qwen35(tied=False))
    context, ids = tokenizer.encode("Once upon a time").ids, tokenizer.encode(PROMPT).ids
    answer, top, p = lens_of(context + ids, 9)
    cache = [None] * li.N_LAYERS
    li.prefill(context, cache)
    mx.eval(cache)
    top2, p2, _ = li.logit_lens(ids + answer[:-1], answer, cache, len(context), chunk=4)
    assert top2.tolist() == top and np.allclose(p2.tolist(), p, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
def test_the_pass_leaves_the_cache_it_goes_on_from(kind, checkpoint, qwen35, tokenizer):
    """The cache given holds room past start (a KV buffer of 256): the pass writes its own."""
    li.load(checkpoint() if kind == "qwen3" else qwen35(tied=False))
    context, ids = tokenizer.encode("Once upon a time").ids, tokenizer.encode(PROMPT).ids
    cache = [None] * li.N_LAYERS
    li.prefill(context, cache)
    mx.eval(cache)
    before = [[np.array(a) for a in entry] for entry in cache]
    li.logit_lens(ids + [5, 6], [7, 8, 9], cache, len(context))
    after = [[np.array(a) for a in entry] for entry in cache]
    assert all(np.array_equal(a, b) for x, y in zip(before, after) for a, b in zip(x, y))


@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
def test_reply_with_explain_leaves_the_runs_cache_as_without(kind, checkpoint, qwen35, tokenizer, capsys):
    li.load(checkpoint() if kind == "qwen3" else qwen35(tied=False))
    ids = tokenizer.encode(PROMPT).ids
    caches = []
    for flags in (["-m", "6"], ["-m", "6", "--explain"]):
        cache = [None] * li.N_LAYERS
        generated = li.reply(ids, li.parse_args(flags), cache)
        mx.eval(cache)
        caches.append((generated, [[np.array(a) for a in entry] for entry in cache]))
    (plain, plain_cache), (explained, explained_cache) = caches
    assert plain == explained
    assert all(np.array_equal(a, b) for x, y in zip(plain_cache, explained_cache) for a, b in zip(x, y))
    assert "the answer forming" in capsys.readouterr().out


def test_logits_that_are_not_finite_are_said(checkpoint, monkeypatch):
    """The run's logits were finite; should a block's lens not be (an overflow), the pass stops
    with not_finite()'s line, naming the block, not a picture of NaN."""
    li.load(checkpoint())
    calls, lm_head = [], li.lm_head

    def overflowing(x):
        calls.append(x)
        return lm_head(x) * (mx.inf if len(calls) == 4 else 1)  # 2 forward()s, block 1, 2
    monkeypatch.setattr(li, "lm_head", overflowing)
    with pytest.raises(FloatingPointError, match="the logits of block 2's logit lens are not finite"):
        li.logit_lens([5, 6, 7], [8, 9], [None] * li.N_LAYERS)


def test_an_answer_of_one_token_and_of_none(checkpoint, tokenizer):
    """One token: one column, read from the prompt's last. None (the first was an EOS id): a line
    says so, and no picture."""
    folder = checkpoint(init="wide")
    li.load(folder)
    ids = tokenizer.encode(PROMPT).ids
    first = next(li.generate(ids, 1))
    one = run_cli("--model", str(folder), "-m", "1", "--explain")
    _, numbers, rows, read, _ = parse_picture(one.stdout)
    assert numbers == [1] and read == [li.cell_text(ids[-1])]
    assert rows[li.N_LAYERS] == [(rows[li.N_LAYERS][0][0], li.cell_text(first), True)]
    none = run_cli("--model", str(checkpoint(init="wide", eos_extra=[first])), "-m", "4", "--explain")
    assert none.returncode == 0 and none.stderr == "", none.stderr
    assert none.stdout.endswith("the answer forming: no token was written (the first was an "
                                "end-of-sequence id)\n")


def test_nothing_is_computed_without_explain(checkpoint, tokenizer, monkeypatch, capsys):
    li.load(checkpoint())

    def never(*args, **kwargs):
        raise AssertionError("the lens ran")
    monkeypatch.setattr(li, "logit_lens", never)
    li.reply(tokenizer.encode(PROMPT).ids, li.parse_args(["-m", "4"]), [None] * li.N_LAYERS)
    assert "the answer forming" not in capsys.readouterr().out


def test_memory_is_linear_in_the_positions(checkpoint, monkeypatch):
    """1,000 and 2,000 answer tokens on the tiny model, 64 positions a chunk: the peak grows by no
    more than 3 copies of the KV cache (its buffer grows by concatenation) and the two numbers
    kept per cell, a position; all the logits at once (blocks x positions x vocabulary, 7.7 KB a
    position here, 15 MB at 2,000) would exceed it."""
    li.load(checkpoint())
    mx.eval(li.W)
    peaks = {}
    for n in (1000, 2000):
        written = np.random.default_rng(0).integers(0, 400, n).tolist()
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        top, p, p_top = li.logit_lens([5, 6, 7] + written[:-1], written, [None] * li.N_LAYERS,
                                      chunk=64)
        assert top.shape == p.shape == p_top.shape == (li.N_LAYERS, n)
        del top, p, p_top
        peaks[n] = mx.get_peak_memory() - base
    vocab = li.W["lm_head.weight"].shape[0]
    per_position = 3 * li.N_LAYERS * 2 * li.N_KV * li.D_HEAD * 4 + li.N_LAYERS * 24
    assert peaks[2000] - peaks[1000] <= 1000 * per_position, peaks
    assert peaks[2000] <= 2000 * per_position + 8 * 64 * vocab * 4, peaks
    assert li.N_LAYERS * vocab * 4 > 1.5 * per_position  # the bound tells all the logits apart


# ─── The picture ───

def width(text):
    """Terminal columns: wide characters 2, marks 0, but U+FE0F makes the emoji before it 2."""
    return sum(1 if c == "\ufe0f" else 0 if unicodedata.category(c) in ("Mn", "Me") else
               2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def split_cells(body):
    """A row's cells, by display columns: a character, 7 columns of text, a character; a space
    between cells -> [(first, text, last)]."""
    cells, i = [], 0
    while i < len(body):
        j = i + 1
        while width(body[i + 1:j]) < li.CELL or j < len(body) and width(body[j]) == 0:
            j += 1
        assert width(body[i + 1:j]) == li.CELL and body[j + 1:j + 2] in ("", " "), body
        cells.append((body[i], body[i + 1:j], body[j]))
        i = j + 2
    return cells


def parse_picture(stdout):
    """--explain's picture, without colour codes -> (heading, numbers, {block: [(glyph, text,
    marked)]}, read [text], the lines after it)."""
    head, rest = stdout.split("the answer forming", 1)[1].split("\n▁▂▃▄▅▆▇█ ", 1)  # the legend
    head = "the answer forming" + head
    legend, *lines = rest.split("\n")
    numbers, rows, read, after = [], {}, [], []
    top = next(line.split()[1] for line in lines if line.startswith("block "))  # the last block
    for line in lines:
        label, body = line[:len(f"block {top}") + 1].rstrip(), line[len(f"block {top}") + 1:]
        if line.startswith("token "):
            numbers += [int(n) for n in body.split()]
        elif line.startswith("block "):
            cells = split_cells(body)
            assert all(mark in " ✓" for _, _, mark in cells)
            rows.setdefault(int(label.split()[1]), []).extend(
                (glyph, text, mark == "✓") for glyph, text, mark in cells)
        elif line.startswith("read "):
            read += [text for _, text, _ in split_cells(body)]
        elif line.strip():
            after.append(line)
    return head, numbers, rows, read, after


@pytest.fixture
def odd_tokens(checkpoint, monkeypatch):
    """The tiny model with added tokens that show the cell rules -> {text: id}."""
    li.load(checkpoint())
    tok = build_tokenizer()
    tok.add_tokens(["日本の首都です", "日本", "e\u0301x", "a\u00a0b", "❤\ufe0f!", "👨\u200d👩\u200d👧",
                    "x\ufffdy", "\u0301ab", "，"])
    monkeypatch.setattr(li, "TOK", tok)
    ids = {text: tok.token_to_id(text) for text in ["日本の首都です", "日本", "e\u0301x", "<|endoftext|>",
                                                    "a\u00a0b", "❤\ufe0f!", "👨\u200d👩\u200d👧", "x\ufffdy",
                                                    "\u0301ab", "，"]}
    ids.update({" is": tok.encode(" is").ids[0], "\n": tok.encode("\n").ids[0],
                "\t": tok.encode("\t").ids[0], "half": tok.encode("日").ids[0],
                "none": li.W["lm_head.weight"].shape[0] - 1})
    assert len(tok.encode(" is").ids) == 1 and tok.id_to_token(ids["none"]) is None
    assert tok.decode([ids["half"]]) == "\ufffd"  # part of 日 (e6 97 a5)
    return ids


CELLS = {" is": "·is    ", "\n": "↵      ", "\t": "U+0009 ", "日本の首都です": "日本の…",
         "日本": "日本   ", "e\u0301x": "e\u0301x     ", "<|endoftext|>": "<|endo…",
         "a\u00a0b": "a…     ", "❤\ufe0f!": "❤\ufe0f!    ", "👨\u200d👩\u200d👧": "👨…    ",
         "x\ufffdy": "x\ufffdy    ", "\u0301ab": "◌\u0301ab    ",
         "，": "，     "}  # (U+FF0C, a fullwidth comma: two columns, as 日 is)


def test_cell_rules(odd_tokens):
    for text, shown in CELLS.items():
        assert li.cell_text(odd_tokens[text]) == shown and width(shown) == li.CELL
    half = li.TOK.id_to_token(odd_tokens["half"])  # its bytes, as the byte-level alphabet spells them
    assert li.cell_text(odd_tokens["half"]) == "<0xE6>…" and len(half) == 2
    assert li.cell_text(odd_tokens["none"]) == f"#{odd_tokens['none']}".ljust(li.CELL)
    assert [li.shade(p, False) for p in (0, 0.124, 0.125, 0.5, 0.874, 0.875, 1.0)] == list("▁▁▂▅▇██")


@pytest.mark.parametrize("columns", [30, 55, 80, 200])
def test_picture_parses_back_to_its_cells_and_fits_the_width(odd_tokens, columns):
    tokens = list(odd_tokens.values())
    n = 11
    top = [[tokens[(b + j) % len(tokens)] for j in range(n)] for b in range(li.N_LAYERS)]
    p = [[((b * 7 + j * 3) % 17) / 16 for j in range(n)] for b in range(li.N_LAYERS)]
    written = [tokens[(li.N_LAYERS - 1 + j) % len(tokens)] if j % 3 else tokens[0] for j in range(n)]
    read = [tokens[j % len(tokens)] for j in range(n)]
    lines = li.lens_picture(top, p, written, read, False, columns, number=5)
    assert all(width(line) <= max(columns, 8 + 10) for line in lines)
    per = max(1, (columns - 8) // 10)
    assert sum(line.startswith("token") for line in lines) == -(-n // per)  # panels
    _, numbers, rows, shown_read, _ = parse_picture("the answer forming\n" + SHADES + " x\n" + "\n".join(lines))
    assert numbers == list(range(5, 5 + n))
    assert sorted(rows) == list(range(1, li.N_LAYERS + 1))
    assert [line.split()[0:2] for line in lines if line.startswith("block")][:li.N_LAYERS] == \
        [["block", str(b)] for b in range(li.N_LAYERS, 0, -1)]  # the last block on top
    for b in range(li.N_LAYERS):
        assert rows[b + 1] == [(SHADES[min(int(p[b][j] * 8), 7)], li.cell_text(top[b][j]),
                                top[b][j] == written[j]) for j in range(n)]
    assert shown_read == [li.cell_text(t) for t in read]


def test_the_command_line_draws_the_grid(checkpoint, tokenizer):
    """Through a pipe, 80 columns (COLUMNS unset): glyphs, no colour codes; greedy in float32, so
    the top row is the answer, every cell marked; the first column read the prompt's last token."""
    folder = checkpoint(init="wide")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    r = subprocess.run([sys.executable, str(ROOT / "llm_inference.py"), "--model", str(folder),
                        "-p", PROMPT, "-m", "12", "--explain"], capture_output=True, text=True,
                       env=dict(env, PYTHONIOENCODING="utf-8"), timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    head, numbers, rows, read, after = parse_picture(r.stdout)
    assert "3 x 12 LM heads" in head and "last" not in head and numbers == list(range(1, 13)) and after == []
    assert all(len(cells) == 12 for cells in rows.values())
    assert all(marked for _, _, marked in rows[li.N_LAYERS])
    li.load(folder)
    assert read[0] == li.cell_text(tokenizer.encode(PROMPT).ids[-1])
    picture = r.stdout.split("▁▂▃▄▅▆▇█ ")[1].splitlines()[1:]  # the panels, after the legend
    assert picture[0].startswith("token ") and max(map(width, picture)) in range(71, 81)
    assert "\x1b[" not in r.stdout


def test_sampled_answer_is_the_one_drawn(checkpoint, tokenizer):
    """At a temperature above 0 the grid is of the answer sampled: each column read the token the
    column before it wrote, and the top row's marks agree with lm_head() by hand."""
    folder = checkpoint(init="wide")
    r = run_cli("--model", str(folder), "-p", PROMPT, "-m", "10", "--explain", "--temp", "1.5",
                "--seed", "7", "--lens-tokens", "0")
    assert r.returncode == 0, r.stderr
    li.load(folder)
    ids = tokenizer.encode(PROMPT).ids
    mx.random.seed(7)
    answer = list(li.generate(ids, 10, li.sampler_of(li.parse_args(["--temp", "1.5"]))))
    assert li.TOK.decode(answer) in r.stdout
    _, _, rows, read, after = parse_picture(r.stdout)
    assert after == []  # no note of a near-tie: a sampled token need not be the top one
    ref_top, ref_p = by_hand(ids + answer[:-1], answer)
    assert read == [li.cell_text(t) for t in (ids + answer)[len(ids) - 1:-1]]
    for b in range(li.N_LAYERS):
        assert rows[b + 1] == [(SHADES[min(int(ref_p[b][j] * 8), 7)], li.cell_text(ref_top[b][j]),
                                ref_top[b][j] == answer[j]) for j in range(10)]
    assert any(not marked for _, _, marked in rows[li.N_LAYERS])  # sampled: not always the top


def test_window_of_the_last_tokens_and_its_flag(checkpoint):
    folder = str(checkpoint(init="wide"))
    whole = run_cli("--model", folder, "-m", "10", "--explain", "--lens-tokens", "0")
    window = run_cli("--model", folder, "-m", "10", "--explain", "--lens-tokens", "4")
    assert whole.returncode == window.returncode == 0, window.stderr
    head, numbers, rows, read, _ = parse_picture(window.stdout)
    _, _, all_rows, all_read, _ = parse_picture(whole.stdout)
    assert "[the answer's last 4 tokens of 10; --lens-tokens 0: all of them]" in head and numbers == [7, 8, 9, 10]
    assert rows == {b: cells[6:] for b, cells in all_rows.items()} and read == all_read[6:]
    assert_error(run_cli("--model", folder, "--explain", "--lens-tokens", "-1"),
                 "--lens-tokens must be 0 or more")


def test_default_window_is_the_last_64_and_the_flag_needs_explain(checkpoint):
    folder = str(checkpoint(init="wide"))
    r = run_cli("--model", folder, "-m", "70", "--explain")
    head, numbers, rows, _, _ = parse_picture(r.stdout)
    assert "\nGeneration: 70 tokens" in r.stdout, r.stdout  # (no end-of-sequence id on the way)
    assert "[the answer's last 64 tokens of 70; --lens-tokens 0: all of them]" in head
    assert numbers == list(range(7, 71)) and all(len(cells) == 64 for cells in rows.values())
    assert_error(run_cli("--model", folder, "--lens-tokens", "3"), "--lens-tokens needs --explain")


@pytest.mark.parametrize("draft", ["mtp", "lookup"])
def test_drafting_draws_the_same_picture(qwen35, draft):
    """Drafting at temperature 0 writes the greedy answer; its picture is the plain run's."""
    folder = str(qwen35(tied=False))
    plain = run_cli("--model", folder, "-m", "8", "--explain")
    drafted = run_cli("--model", folder, "-m", "8", "--explain", "--draft", draft)
    assert drafted.returncode == 0 and "Draft: " in drafted.stdout, drafted.stderr
    assert parse_picture(drafted.stdout)[1:] == parse_picture(plain.stdout)[1:]


def pty_run(*args, env=None):
    """The CLI with a pseudo-terminal as stdout and stderr -> what the screen got."""
    leader, follower = pty.openpty()
    env = {**{k: v for k, v in os.environ.items() if k != "NO_COLOR"}, "PYTHONIOENCODING": "utf-8",
           "TERM": "xterm", **(env or {})}
    p = subprocess.Popen([sys.executable, str(ROOT / "llm_inference.py"), *args], stdin=subprocess.DEVNULL,
                         stdout=follower, stderr=follower, env=env)
    os.close(follower)
    seen, deadline = b"", time.time() + 120
    while time.time() < deadline:
        if select.select([leader], [], [], 1)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        elif p.poll() is not None:
            break
    p.wait(timeout=10)
    os.close(leader)
    assert p.returncode == 0, seen
    return seen.decode().replace("\r\n", "\n")


def test_colour_at_a_terminal_glyphs_with_no_color_or_a_dumb_one(checkpoint):
    folder = str(checkpoint(init="wide"))
    flags = ["--model", folder, "-m", "11", "--explain"]
    coloured = pty_run(*flags, env={"COLUMNS": "40"})  # panels of 3 columns: 8 + 3 x 10
    piped = run_cli(*flags).stdout
    plain = re.sub(r"\x1b\[[0-9;]*m", "", coloured)
    picture = plain.split("the answer forming")[1].split("\ntoken ", 1)[1].split("\n")
    assert "\x1b[48;5;" in coloured and not set(SHADES) & set("".join(picture))
    assert sum(line.startswith("token ") for line in picture) == 3  # and the first: 4 panels
    assert max(width(line) for line in picture) == 37  # 8 + 3 x 10 - 1: 3 columns a panel
    _, _, rows, read, _ = parse_picture(piped)
    for b, cells in rows.items():  # the same cells; the shade as a grey level, 233 + 3 x glyph's
        lines = [line for line in coloured.split("\n") if line.startswith(f"block {b} ")]
        greys = [int(g) for line in lines for g in re.findall(r"\x1b\[48;5;(\d+);", line)]
        assert greys == [233 + 3 * SHADES.index(glyph) for glyph, _, _ in cells]
        assert all(re.fullmatch(r"block \d (\x1b\[48;5;[\d;]+m [^\x1b]+\x1b\[0m ?)+", line)
                   for line in lines)  # each cell's colour ended in the cell
    for env in ({"NO_COLOR": "1"}, {"TERM": "dumb"}):
        shown = pty_run(*flags, env=env)
        assert "\x1b[" not in shown
        shown = re.sub(r"\r\[the logit lens: [^\]]*\]|\r +\r", "", shown)  # progress, blanked
        assert parse_picture(shown)[2] == rows


def test_progress_at_a_terminal_blanked_after(checkpoint):
    folder = str(checkpoint())
    shown = pty_run("--model", folder, "-p", "The capital of France is Paris." * 60, "-m", "2",
                    "--explain")
    steps = re.findall(r"\r\[the logit lens: positions (\d+) of (\d+), block (\d) of 3\]", shown)
    assert steps[-1][0] == steps[-1][1] and steps[-1][2] == "3" and int(steps[0][1]) > 512
    assert steps[0] == ("512", steps[0][1], "1") or steps[0][0] == steps[0][1]  # a chunk at a time
    last = f"[the logit lens: positions {steps[-1][0]} of {steps[-1][1]}, block 3 of 3]"
    assert f"\r{last}\r{' ' * len(last)}\r" in shown  # the last, then blanked


def test_progress_blanked_on_every_way_out(checkpoint, monkeypatch):
    """A pass that fails (an overflow here) or is stopped leaves no progress line behind."""
    li.load(checkpoint())

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stderr", Terminal())
    lm_head, calls = li.lm_head, []

    def overflowing(x):  # block 2's lens overflows, after block 1's progress line
        calls.append(x)  # (the first two: forward()'s own in the prompt's pass and the answer's)
        return lm_head(x) * (mx.inf if len(calls) == 4 else 1)
    monkeypatch.setattr(li, "lm_head", overflowing)
    with pytest.raises(FloatingPointError, match="block 2's logit lens"):
        li.logit_lens([5, 6, 7], [8, 9], [None] * li.N_LAYERS, progress=True)
    last = "[the logit lens: positions 3 of 3, block 1 of 3]"
    assert sys.stderr.getvalue() == f"\r{last}\r{' ' * len(last)}\r"


def test_ctrl_c_stops_the_picture_and_keeps_the_answer(checkpoint, tokenizer, monkeypatch, capsys):
    """In a chat, Ctrl-C in the picture stops it alone: the answer and its cache are kept, and the
    next turn reuses as much as without it. Elsewhere (a caller's loop) it goes on up, after the
    same line."""
    li.load(checkpoint())
    lens, stops, chats = li.logit_lens, [], []

    def interrupted(*args, **kwargs):  # the first turn's picture, when asked, is stopped
        if stops.pop() if stops else False:
            raise KeyboardInterrupt
        return lens(*args, **kwargs)
    monkeypatch.setattr(li, "logit_lens", interrupted)
    for stop in (False, True):
        stops[:] = [False, stop]  # popped: the first turn's, then the second's
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello there\nAnd Japan?\n")))
        try:
            li.chat_turns(li.parse_args(["--chat", "-m", "3", "--explain"]), False)
        except KeyboardInterrupt:  # (uncaught, it would stop pytest itself)
            pytest.fail("Ctrl-C in the picture ended the chat")
        chats.append(capsys.readouterr().out.split("[KV cache: ")[1:])
    (plain, plain2), (stopped, stopped2) = chats
    assert stopped.endswith("[the answer forming: stopped]\n") and "stopped" not in plain
    assert stopped.split("==========")[1] == plain.split("==========")[1]  # the answer kept
    assert stopped2.split("]")[0] == plain2.split("]")[0]  # "N tokens reused, M new to prefill"
    assert int(plain2.split()[0]) > len(tokenizer.encode("Hello there").ids) + 3
    ids = tokenizer.encode(PROMPT).ids
    stops[:] = [True]
    with pytest.raises(KeyboardInterrupt):
        li.reply(ids, li.parse_args(["-m", "3", "--explain"]), [None] * li.N_LAYERS)
    assert capsys.readouterr().out.endswith("[the answer forming: stopped]\n")


def test_an_empty_answer_gives_an_empty_lens(checkpoint):
    li.load(checkpoint())
    assert [a.shape for a in li.logit_lens([5, 6], [], [None] * li.N_LAYERS)] == [(li.N_LAYERS, 0)] * 3
    with pytest.raises(ValueError, match="3 ids written after 2 positions"):
        li.logit_lens([5, 6], [1, 2, 3], [None] * li.N_LAYERS)


@pytest.mark.parametrize("kind", ["qwen35", "quantized"])
def test_qwen35_and_a_quantised_folder(kind, qwen35, quantized):  # noqa: F811
    folder = qwen35(tied=False) if kind == "qwen35" else quantized("4bit-g64-untied")
    r = run_cli("--model", str(folder), "-m", "8", "--explain")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    li.load(folder)
    head, numbers, rows, _, after = parse_picture(r.stdout)
    assert sorted(rows) == list(range(1, li.N_LAYERS + 1)) and numbers == list(range(1, 9))
    unmarked = [j + 1 for j, (_, _, marked) in enumerate(rows[li.N_LAYERS]) if not marked]
    if kind == "qwen35":  # float32: the top row is the answer
        assert unmarked == [] and after == []
    else:  # bfloat16: a near-tie may flip, and is said, with the two probabilities
        notes = [re.fullmatch(r"\[note: token (\d+): the top row's ([\d.]+) against ([\d.]+) for the "
                              r"token written, a near-tie this pass, summing in another order in "
                              r"bfloat16, broke the other way\]", line) for line in after]
        assert all(notes) and [int(m[1]) for m in notes] == unmarked and len(unmarked) <= 2
        assert all(float(m[2]) - float(m[3]) < 0.05 for m in notes)


def test_each_chat_turn_draws_its_answers_grid(checkpoint, tokenizer):
    folder = str(checkpoint(init="wide"))
    r = run_cli("--model", folder, "--chat", "--explain", "-m", "5", stdin=b"Hello there\nAnd Japan?\n")
    assert r.returncode == 0, r.stderr
    turns = r.stdout.split("[KV cache: ")[1:]
    assert len(turns) == 2
    for turn in turns:
        _, numbers, rows, _, _ = parse_picture(turn)
        assert numbers == list(range(1, len(rows[li.N_LAYERS]) + 1))
        assert all(marked for _, _, marked in rows[li.N_LAYERS])  # float32, greedy


def test_near_tie_notes_name_the_answers_own_tokens_in_a_window(checkpoint, monkeypatch, capsys):
    """Only the answer's last 4 of 10 tokens drawn: a column whose top row is not the token written
    (here the 2nd and 4th drawn: tokens 8 and 10) is named by its place in the answer, with its own
    two probabilities; the others, and every column when sampling, get no note."""
    li.load(checkpoint())
    generated = list(range(20, 30))
    top = [g if j not in (1, 3) else 99 for j, g in enumerate(generated[6:])]
    p_top, p = [0.5, 0.61, 0.5, 0.73], [0.5, 0.39, 0.5, 0.27]

    def lens(token_ids, written, *args, **kwargs):  # the last block's row is the one read
        assert written == generated[6:]
        return [li.mx.array([row] * li.N_LAYERS) for row in (top, p, p_top)]

    monkeypatch.setattr(li, "logit_lens", lens)
    li.answer_forming([5, 6, 7], generated, [None] * li.N_LAYERS, 0, columns=4)
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[note")]
    assert [re.match(r"\[note: token (\d+): the top row's ([\d.]+) against ([\d.]+)", line).groups()
            for line in notes] == [("8", "0.6100", "0.3900"), ("10", "0.7300", "0.2700")]
    li.answer_forming([5, 6, 7], generated, [None] * li.N_LAYERS, 0, columns=4, greedy=False)
    assert "[note" not in capsys.readouterr().out
