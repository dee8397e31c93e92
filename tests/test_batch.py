"""Batching (Part II, generate_batch()): several prompts decode together, one pass of the model
over one token of each, and a finished row makes room for the next prompt. Proven exact in
float32: each row's tokens are the ones its prompt gives alone through generate()."""
from functools import partial

import mlx.core as mx
import pytest

import llm_inference as li
from test_cli_errors import assert_error, overflowing, run_cli  # noqa: F401 (a fixture)
from test_quantized import quantized  # noqa: F401 (the fixture)

TEXTS = ["The capital of France is", "Once", "def f(x):\n    return x * 2  # code, too",
         "日本の首都は東京です。", "Emoji: 😀 👍🏽 and numbers 0123456789", "a"]


def alone(prompts, n, **sampling):
    return [list(li.generate(ids, max_tokens=n, **sampling)) for ids in prompts]


def batched(prompts, n, batch_size, **options):
    out = [[] for _ in prompts]
    for i, token in li.generate_batch(prompts, max_tokens=n, batch_size=batch_size, **options):
        out[i].append(token)
    return out


@pytest.mark.parametrize("batch_size", [1, 2, 4, 6])
def test_each_row_is_its_prompt_alone(checkpoint, batch_size):
    """Prompts of different lengths; with fewer rows than prompts, rows leave and others join."""
    li.load(checkpoint())
    prompts = [li.tokenize(t) for t in TEXTS]
    assert len({len(ids) for ids in prompts}) == len(prompts)
    assert batched(prompts, 12, batch_size) == alone(prompts, 12)


def test_rows_ending_at_different_times_leave_the_batch(checkpoint, monkeypatch):
    """A token of one row made an EOS id: that row ends there, the others go on; once its EOS is
    seen the batch is a row smaller (a finished row costs no more products), and the waiting
    prompt joins in the row it frees."""
    li.load(checkpoint())
    prompts = [li.tokenize(t) for t in TEXTS[:4]]
    free = alone(prompts, 12)
    j = next(j for j in range(2, 12) if free[1][j] not in free[1][:j])  # a token new to row 1
    monkeypatch.setattr(li, "EOS_IDS", li.EOS_IDS | {free[1][j]})
    expected = alone(prompts, 12)
    assert len(expected[1]) == j and any(len(ids) == 12 for ids in expected)
    sizes, forward_batch = [], li.forward_batch

    def counting(token_ids, caches, starts):
        sizes.append(len(starts))
        return forward_batch(token_ids, caches, starts)

    monkeypatch.setattr(li, "forward_batch", counting)
    assert batched(prompts[:3], 12, 3) == expected[:3]
    # Call 0 runs the prompts' last ids, call n + 1 makes token n + 1. Like generate(), each step
    # is queued before the tokens it follows are looked at: the step after the EOS (call j + 1)
    # still holds the row, the next one no longer.
    assert sizes[:j + 2] == [3] * (j + 2) and sizes[j + 2] == 2
    sizes.clear()
    assert batched(prompts, 12, 3) == expected  # prompt 4 joins where prompt 2 left: its last id
    assert sizes[j + 2] == 3  # rides in the next pass with the others' tokens


def test_a_row_at_the_contexts_end(checkpoint):
    """A prompt near max_position_embeddings stops there, as generate() does; the others go on."""
    li.load(checkpoint(max_position_embeddings=24))
    prompts = [li.tokenize(t) for t in TEXTS[:3]]
    expected = alone(prompts, 20)
    assert len(expected[2]) == 24 - len(prompts[2]) < 20
    assert batched(prompts, 20, 3) == expected


def test_qwen35_rows_keep_their_own_notes(qwen35):
    """Qwen3.5: each row its own DeltaNet state and convolution window, and its KV caches."""
    li.load(qwen35())
    prompts = [li.tokenize(t) for t in TEXTS[:5]]
    assert batched(prompts, 10, 3) == alone(prompts, 10)


@pytest.mark.parametrize("model", ["qwen3", "qwen35"])
def test_prompts_joining_together(checkpoint, qwen35, model):
    """Prompts that join at once are prefilled side by side: Qwen3's all of them (the shorter
    padded at the end), Qwen3.5's those of one length (a DeltaNet cannot skip padding): here
    three prompts of one length among others, rows leaving and joining, each its own tokens."""
    li.load(checkpoint() if model == "qwen3" else qwen35())
    prompts = [li.tokenize(t) for t in TEXTS[:5]]
    prompts = [prompts[0], prompts[2], prompts[0][:-1] + prompts[1][:1], prompts[0], prompts[3]]
    assert len(prompts[0]) == len(prompts[2]) == len(prompts[3])
    for batch_size in (5, 3):
        assert batched(prompts, 8, batch_size) == alone(prompts, 8)


def test_quantised_rows(quantized):  # noqa: F811
    li.load(quantized("4bit-g64-untied"), mx.float32)
    prompts = [li.tokenize(t) for t in TEXTS[:4]]
    assert batched(prompts, 8, 4) == alone(prompts, 8)


def test_sampling_with_a_seed_is_reproducible(checkpoint):
    """The rows draw from the model's distribution in a fixed order: the same seed, the same
    tokens (not the tokens of single runs, whose draws come in another order)."""
    li.load(checkpoint())
    prompts = [li.tokenize(t) for t in TEXTS[:4]]
    runs = []
    for _ in range(2):
        mx.random.seed(3)
        runs.append(batched(prompts, 10, 2, sampler=partial(li.sample, temperature=1.0, top_p=0.9)))
    assert runs[0] == runs[1] and len({tuple(ids) for ids in runs[0]}) > 1


def one_batched_step(prompts):
    """Each prompt's cache filled alone (all but its last id) and put in its slot of one batch
    cache; then one batch pass over the prompts' last ids, and the same step for each prompt
    alone -> the batch's logits (B, vocab), each row's alone [(vocab,)]."""
    cache, singles = [None] * li.N_LAYERS, []
    for b, ids in enumerate(prompts):
        own = [None] * li.N_LAYERS
        li.forward(ids[:-1], own, 0)
        mx.eval(own)
        li.take_slots(cache, [b], [None if e is None else tuple(a[None] for a in e) for e in own])
        singles.append(li.forward(ids[-1:], list(own), len(ids) - 1)[-1])
    rows = li.forward_batch(mx.array([ids[-1] for ids in prompts]), cache,
                            [len(ids) - 1 for ids in prompts])
    return rows, singles


@pytest.mark.parametrize("model", ["qwen3", "qwen35", "quantised"])
def test_a_batched_step_is_each_row_alone(checkpoint, qwen35, quantized, model):  # noqa: F811
    """float32: one batch pass over rows at different positions (each its own RoPE angle, its own
    keys behind its mask, its own DeltaNet notes) gives each row the logits of the same step run
    alone, to float32's rounding of a product over more rows (measured: under 1e-5 of the largest
    logit; a row turned by another row's position, or reading another's keys, moves them by far
    more)."""
    if model == "quantised":
        li.load(quantized("4bit-g64-untied"), mx.float32)
    else:
        li.load(checkpoint() if model == "qwen3" else qwen35())
    prompts = [li.tokenize(t) for t in TEXTS[:5]]
    rows, singles = one_batched_step(prompts)
    for row, single in zip(rows, singles):
        assert mx.abs(row - single).max().item() <= 1e-4 * mx.abs(single).max().item()


def test_bfloat16_rows_round_as_a_single_row_does(checkpoint):
    """In bfloat16 a product over B rows may round differently from one row's (so two correct
    runs can part ways where two tokens are close): the suite asserts that each row's logits in a
    batched step are within bfloat16's rounding of the same step alone, not that tokens agree."""
    li.load(checkpoint(dtype="bfloat16"))
    rows, singles = one_batched_step([li.tokenize(t) for t in TEXTS[:3]])
    for row, single in zip(rows, singles):
        err = mx.abs(row.astype(mx.float32) - single.astype(mx.float32)).max().item()
        assert err <= 0.02 * mx.abs(single.astype(mx.float32)).max().item()


def test_each_row_draws_its_own_sample(checkpoint):
    """Six copies of one prompt, sampled at temperature 1 in one batch: each row its own draws, so
    the rows part ways (one draw shared by every row would keep them identical)."""
    li.load(checkpoint())
    mx.random.seed(1)
    out = batched([li.tokenize("Once")] * 6, 8, 6, sampler=partial(li.sample, temperature=1.0))
    assert len({tuple(ids) for ids in out}) > 1


def test_memory_is_bounded_by_the_batch_size(checkpoint):
    """Many more prompts than --batch-size: a finished sequence's slot goes to the next prompt and
    nothing of it is kept. The memory the batch holds, read at every token it yields, is the same
    for 48 prompts through 4 slots as for 4 prompts (measured: equal to the byte, but for a few
    hundred bytes of bookkeeping; a cache kept per finished prompt would grow 12-fold). The peak,
    which a join's copies raise for a moment and the timing of the queued passes moves, does not
    grow with the prompts either: 48 against 8 measured 0.98-1.10x, asserted within 25%."""
    li.load(checkpoint())
    prompts = [li.tokenize(t) for t in TEXTS[:4]]
    held, peaks = [], []
    for n in (1, 2, 12):
        mx.eval(li.W)
        mx.clear_cache()
        mx.reset_peak_memory()
        base, most = mx.get_active_memory(), 0
        for _ in li.generate_batch(prompts * n, max_tokens=12, batch_size=4):
            most = max(most, mx.get_active_memory() - base)
        held.append(most)
        peaks.append(mx.get_peak_memory() - base)
    assert held[2] <= 1.01 * held[0] and held[1] <= 1.01 * held[0], held
    assert peaks[2] <= 1.25 * peaks[1], peaks


def test_a_long_row_that_leaves_takes_its_positions_with_it(checkpoint):
    """A 1,500-token prompt, then 16 short ones through 4 slots: once the long row has ended (and
    a pass has run since), the memory the batch holds is what the 16 short prompts hold alone;
    kept, the long row's 1,536 positions in every slot would hold 6x as much. The short rows'
    tokens are still their prompts' alone."""
    li.load(checkpoint())
    short = [li.tokenize(t) for t in TEXTS[:4]] * 4
    long = (li.tokenize(TEXTS[2]) * 200)[:1500]

    def most_held(prompts):  # the most memory the batch holds at a yield a pass after row 0 ends
        mx.eval(li.W)
        mx.clear_cache()
        base, most, ended, out, after = mx.get_active_memory(), 0, [], [[] for _ in prompts], 0
        for i, token in li.generate_batch(prompts, max_tokens=12, batch_size=4, ended=ended):
            out[i].append(token)
            after += any(end[0] == 0 for end in ended)
            if after > 4:  # every row has been through a pass since
                most = max(most, mx.get_active_memory() - base)
        return most, out

    with_long, out = most_held([long] + short)
    alone_short, _ = most_held([short[0]] + short)
    assert out[1:] == alone(short, 12)
    assert 0 < with_long <= 1.05 * alone_short, (with_long, alone_short)


def test_command_line(checkpoint, tmp_path):
    """--prompt given 3 times and --prompts FILE: each completion after its prompt, in the
    prompts' order, equal to each prompt's own run; the batch's statistics."""
    folder = str(checkpoint())
    singles = [run_cli("--model", folder, "-p", t, "-m", "6").stdout.split("==========")[1]
               for t in TEXTS[:3]]
    r = run_cli("--model", folder, "-p", TEXTS[0], "-p", TEXTS[1], "-p", TEXTS[2], "-m", "6",
                "--batch-size", "2")
    assert r.returncode == 0, r.stderr
    parts = r.stdout.split("==========\n")
    assert parts[1:4] == [s.lstrip("\n") for s in singles]
    assert "Prompt: " in parts[4] and "3 prompts, --batch-size 2" in parts[4]
    assert "Generation: " in parts[4] and "KV cache: " in parts[4] and "in 3 sequences" in parts[4]
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(TEXTS[:3]).replace("\n    return", " return") + "\n\n")
    r2 = run_cli("--model", folder, "--prompts", str(file), "-m", "6")
    assert r2.returncode == 0 and r2.stdout.count("==========\n") == 4, r2.stderr


def test_flags_that_do_not_go_together(checkpoint, tmp_path):
    folder = str(checkpoint())
    assert_error(run_cli("--model", folder, "-p", "a", "-p", "b", "--explain"),
                 "--explain and --show-probs show one prompt")
    assert_error(run_cli("--model", folder, "-p", "a", "-p", "b", "--show-probs", "3"),
                 "--explain and --show-probs show one prompt")
    assert_error(run_cli("--model", folder, "-p", "a", "--batch-size", "0"),
                 "--batch-size must be at least 1")
    (tmp_path / "empty.txt").write_text("\n\n")
    assert_error(run_cli("--model", folder, "--prompts", str(tmp_path / "empty.txt")),
                 "empty.txt has no prompt (one a line)")
    assert_error(run_cli("--model", folder, "--prompts", str(tmp_path / "missing.txt")),
                 "missing.txt does not exist")


@pytest.mark.parametrize("model", ["qwen3", "qwen35"])
def test_prompts_longer_than_a_chunk(checkpoint, qwen35, monkeypatch, model):
    """A joining prompt fills its cache CHUNK at a time (made 4 here), all but its last id, which
    goes into the next batch pass beside the other rows' tokens."""
    li.load(checkpoint() if model == "qwen3" else qwen35())
    monkeypatch.setattr(li, "CHUNK", 4)
    prompts = [li.tokenize(t) for t in TEXTS[:5]]
    assert max(len(ids) for ids in prompts) > 3 * 4
    assert batched(prompts, 8, 2) == alone(prompts, 8)


@pytest.mark.parametrize("call, n_good", [(0, 0), (3, 3)])
def test_a_row_whose_logits_are_not_finite(checkpoint, monkeypatch, call, n_good):
    """A NaN in one of row 2's logits, at its first token (call 0) or its fourth (call 3): generate_batch()
    says which prompt, and no token from those logits comes out; the tokens before it are right."""
    li.load(checkpoint())
    prompts = [li.tokenize(t) for t in TEXTS[:3]]
    expected, calls, forward_batch = alone(prompts, 8), [], li.forward_batch

    def poisoned(token_ids, caches, starts):
        logits = forward_batch(token_ids, caches, starts)            # (3, vocab)
        calls.append(len(calls))
        if len(calls) - 1 == call:
            logits = mx.where((mx.arange(3)[:, None] == 1) & (mx.arange(logits.shape[1]) == 7),
                              mx.nan, logits)  # one logit of row 2
        return logits

    monkeypatch.setattr(li, "forward_batch", poisoned)
    out = [[] for _ in prompts]
    with pytest.raises(FloatingPointError, match=r"^the logits of prompt 2 are not finite \(NaN "
                       r"or inf\) in float32: the activations overflow it$"):
        for i, token in li.generate_batch(prompts, max_tokens=8, batch_size=3):
            out[i].append(token)
    assert out[1] == expected[1][:n_good]
    assert all(ids == expected[i][:len(ids)] for i, ids in enumerate(out))


def test_overflowing_rows_through_the_command_line(overflowing):
    """float16 activations that overflow, several prompts: one line naming the first prompt whose
    logits are not finite and the dtype, exit 1, and not a word of any completion."""
    folder = str(overflowing)
    assert run_cli("--model", folder, "-p", "a", "-p", "b", "-m", "3").returncode == 0
    r = run_cli("--model", folder, "-p", "a", "-p", "b", "-m", "3", "--dtype", "float16")
    assert_error(r, "the logits of prompt 1 are not finite (NaN or inf) in float16: the "
                 "activations overflow it; compute in float32 (--dtype float32)")
    assert "==========" not in r.stdout  # the model's line only, no completion


def test_batch_quiet_long_prompts_and_bytes(checkpoint):
    """-q prints each completion alone, in the prompts' order; a prompt longer than the context,
    among others, is refused before any output; the statistics give a row's bytes per token: the
    weights shared by --batch-size rows, and its cache."""
    folder = str(checkpoint())
    loud = run_cli("--model", folder, "-p", TEXTS[0], "-p", TEXTS[1], "-m", "5")
    quiet = run_cli("--model", folder, "-p", TEXTS[0], "-p", TEXTS[1], "-m", "5", "-q")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    parts = loud.stdout.split("==========\n")[1:3]
    assert quiet.stdout == "".join(part[len(text):] for part, text in zip(parts, TEXTS[:2]))
    li.load(folder)
    weights = li.token_bytes([], 0)[0]
    assert f"Bytes per token, a row of 2: {weights / 2 / 1e6:.3f} MB of weights + " in loud.stdout
    long = " ".join(["The capital of France is Paris."] * 400)
    r = run_cli("--model", folder, "-p", "a", "-p", long, "-m", "3")
    assert_error(r, "tokens; the context holds 2048")
    assert r.stdout == ""


def test_batched_chat_replies_are_labelled_with_their_prompts(checkpoint):
    """--chat with several prompts: each reply after ">> " and its prompt, in the prompts' order."""
    r = run_cli("--model", str(checkpoint()), "--chat", "-p", "Hi", "-p", "Yo", "-m", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.index("==========\n>> Hi\n") < r.stdout.index("==========\n>> Yo\n")


def test_the_batchs_attention_is_step_5s_mapped_over_its_rows(checkpoint):
    """attend_batch() is mx.vmap(attend): each row Step 5's one-sequence attend(), bit for bit
    (float32 and bfloat16), each row with its own mask."""
    li.load(checkpoint())
    B, L, S, H, KV, hd = 3, 2, 9, li.N_HEADS, li.N_KV, li.D_HEAD
    for dtype in (mx.float32, mx.bfloat16):
        q = mx.random.normal((B, L, H, hd), key=mx.random.key(0)).astype(dtype)
        k, v = (mx.random.normal((B, KV, S, hd), key=mx.random.key(i)).astype(dtype) for i in (1, 2))
        visible = mx.random.uniform(shape=(B, L, S), key=mx.random.key(3)) > 0.4
        visible[..., 0] = True  # every query sees a key
        mapped = mx.vmap(li.attend)(q, k, v, visible)
        assert mx.array_equal(li.attend_batch(q, k, v, visible), mapped).item(), dtype
        assert mx.array_equal(mapped[1], li.attend(q[1], k[1], v[1], visible[1])).item()


class FakeTerminal:
    """A stderr that says it is a terminal and keeps what is written to it."""
    def __init__(self):
        self.written = []

    def isatty(self):
        return True

    def write(self, text):
        self.written.append(text)

    def flush(self):
        pass


def test_the_progress_line_is_taken_away_when_the_batch_fails(checkpoint, monkeypatch):
    """At a terminal the batch shows a progress line; when the batch fails (here a row's logits
    not finite, after 16 tokens), that line is gone from the screen before the error is said."""
    li.load(checkpoint())
    stderr = FakeTerminal()

    def failing(*args):
        for n in range(16):
            yield n % 2, 5
        raise li.not_finite("of prompt 1", mx.float16)

    monkeypatch.setattr(li, "generate_batch", failing)
    monkeypatch.setattr(li.sys, "stderr", stderr)
    args = li.parse_args(["-p", "a", "-p", "b", "-m", "8"])
    with pytest.raises(FloatingPointError):
        li.reply_batch(["a", "b"], [[5, 6], [7, 8]], args)
    text = "".join(stderr.written)
    assert "prompts done" in text  # it was shown
    assert text.split("\r")[-1].strip() == "" and text.endswith("\r"), repr(text)  # and is gone
