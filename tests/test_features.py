"""The teaching features (issue 3): --show-probs, the chat template, the KV cache kept between
chat turns, and the weights fetched on first run."""
import ast
import os
import re
import select
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

import llm_inference as li
from test_cli_errors import ROOT, assert_error, run_cli
from test_model import rel_err


def test_show_probs_equal_softmax_of_mlx_lm(checkpoint, tokenizer):
    folder = checkpoint()
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt).ids
    model, _ = load_model(Path(folder))
    probs = mx.softmax(model(mx.array(ids)[None])[0, -1].astype(mx.float32))
    top = mx.argsort(-probs)[:6].tolist()
    r = run_cli("--model", str(folder), "--prompt", prompt, "--show-probs", "6", "-m", "1")
    assert r.returncode == 0, r.stderr
    rows = [parse_row(row) for row in r.stdout.split("\n==========")[0].splitlines()[1:]]
    assert len(rows) == 6  # after the model summary
    for (shown, p), token in zip(rows, top):
        assert shown == tokenizer.decode([token], skip_special_tokens=False)  # quoted: spaces show
        assert p == pytest.approx(probs[token].item(), rel=1e-3)  # 4 significant digits
    assert [p for _, p in rows] == sorted((p for _, p in rows), reverse=True)


def parse_row(row):
    """"'<token>' <probability> <bar>" -> (token, probability); the bar is 30 blocks for 1."""
    match = re.fullmatch(r"\s*(?P<text>'.*'|\".*\") (?P<p>\S+) *(?P<bar>█*)", row)
    assert match, row
    p = float(match["p"])
    assert len(match["bar"]) == round(30 * p), row
    return ast.literal_eval(match["text"]), p


@pytest.mark.parametrize("system", [None, "You are terse. 🙂"])
@pytest.mark.parametrize("think", [True, False])
def test_chat_prompt_is_qwen3_template(checkpoint, tokenizer, system, think):
    li.load(checkpoint())  # a Qwen3 (an earlier test may have left a Qwen3.5 loaded)
    question = "What is the capital of France? 🇫🇷"
    expected = (f"<|im_start|>system\n{system}<|im_end|>\n" if system else "") + \
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n" + \
        ("" if think else "<think>\n\n</think>\n\n")
    assert li.chat_prompt([question], system, think) == expected
    ids = tokenizer.encode(expected).ids
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == (3 if system else 2)  # one id each
    folder = checkpoint()
    flags = (["--system", system] if system else []) + ([] if think else ["--no-think"])
    r = run_cli("--model", str(folder), "--chat", "--prompt", question, "-m", "8", *flags)
    assert r.returncode == 0, r.stderr
    li.load(folder)
    reply = "".join(piece for _, piece in li.stream_text(li.generate(ids, max_tokens=8)))
    assert f"==========\n{reply}\n==========" in r.stdout


def test_chat_template_drops_earlier_thinking():
    turns = ["Hi", "<think>\nThe user greets me.\n</think>\n\nHello!", "Bye", "\nNo thinking here"]
    assert li.chat_prompt(turns + ["Again"]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n\nNo thinking here<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n")


def test_generation_stops_at_im_end(checkpoint, tokenizer):
    li.load(checkpoint())
    assert tokenizer.token_to_id("<|im_end|>") in li.EOS_IDS


def test_reused_cache_equals_fresh_forward(checkpoint, tokenizer):
    """Turn 2 computes only its new tokens on top of turn 1's cache; where the template drops
    turn 1's thinking, the cache is cut back to the common prefix: turn 2 writes over what
    follows it. Logits equal a fresh forward."""
    li.load(checkpoint())
    cache = [None] * li.N_LAYERS
    ids1 = tokenizer.encode(li.chat_prompt(["Hello there"])).ids
    reply = list(li.generate(ids1, max_tokens=10, cache=cache))
    cached = ids1 + reply[:-1]  # what main() says the cache holds
    ids2 = tokenizer.encode(li.chat_prompt(["Hello there", tokenizer.decode(reply), "And Japan?"])).ids
    for cached_ids, prompt_ids in [(cached, ids2), (None, None)]:
        if cached_ids is None:  # a reply with thinking, which the next prompt leaves out
            cache = [None] * li.N_LAYERS
            thought = tokenizer.encode("<think>\nhmm\n</think>\n\nParis.").ids
            mx.eval(li.forward(ids1 + thought, cache, 0))
            cached_ids = ids1 + thought
            prompt_ids = tokenizer.encode(li.chat_prompt(["Hello there", "<think>\nhmm\n</think>\n\nParis.",
                                                          "And Japan?"])).ids
        n = li.shared_positions(cached_ids, prompt_ids)
        assert 0 < n < len(prompt_ids) and n < len(cached_ids)  # a real cut: stale positions follow
        assert prompt_ids[:n] == cached_ids[:n] and prompt_ids[n] != cached_ids[n]
        ours = li.forward(prompt_ids[n:], cache, n)
        fresh = li.forward(prompt_ids, [None] * li.N_LAYERS, 0)[n:]
        assert rel_err(ours, fresh) < 1e-5
    assert n == len(ids1)  # thinking dropped: reuse stops right after "<|im_start|>assistant\n"


def test_chat_turn_after_a_cut_across_a_buffer_boundary(checkpoint, tokenizer):
    """Turn 1 fills the cache past 256 positions (the buffer grew); turn 2 keeps fewer than 256
    of them and writes its own tokens over the stale ones, on both sides of the boundary."""
    li.load(checkpoint())
    long_question = "The capital of France is Paris. " * 40
    ids1 = tokenizer.encode(li.chat_prompt([long_question])).ids
    cache = [None] * li.N_LAYERS
    reply = list(li.generate(ids1, max_tokens=4, cache=cache))
    assert len(ids1) > 256 and cache[0][0].shape[1] == 512
    cached = ids1 + reply[:-1]
    ids2 = tokenizer.encode(li.chat_prompt(["The capital of Japan is Tokyo. " * 40])).ids
    n = li.shared_positions(cached, ids2)
    assert 0 < n < 256 < len(ids2)
    ours = list(li.generate(ids2[n:], max_tokens=8, cache=cache, start=n))
    assert ours == list(li.generate(ids2, max_tokens=8))


def test_two_turn_conversation_over_stdin(checkpoint, tokenizer):
    folder = checkpoint()
    r = run_cli("--model", str(folder), "--chat", "-m", "6", stdin="Hello there\nAnd Japan?\n".encode())
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    counts = [tuple(map(int, m)) for m in re.findall(r"\[KV cache: (\d+) tokens reused, (\d+) new", r.stdout)]
    assert len(counts) == 2 and counts[0][0] == 0  # two turns, then end of input ends it
    li.load(folder)
    ids1 = tokenizer.encode(li.chat_prompt(["Hello there"])).ids
    reply1 = list(li.generate(ids1, max_tokens=6))
    ids2 = tokenizer.encode(li.chat_prompt(["Hello there", tokenizer.decode(reply1), "And Japan?"])).ids
    assert counts[0][1] == len(ids1) and sum(counts[1]) == len(ids2)
    assert counts[1][0] > len(ids1) // 2 and counts[1][1] < len(ids2)  # turn 2 prefilled less
    reply2 = "".join(piece for _, piece in li.stream_text(li.generate(ids2, max_tokens=6)))
    assert r.stdout.rstrip().count("==========") == 4
    assert reply2 + "\n==========" in r.stdout  # the same reply as from a fresh, full prefill


def test_chat_turn_after_a_reply_cut_at_max_tokens(checkpoint, tokenizer):
    """A reply that ends at --max-tokens: generate() has run its last token into the cache too
    (lazily: MLX computes it when the next turn needs it), so the next turn reuses it: the reuse
    count includes it, and the reply equals a fresh run of the whole prompt. With -m 1 the reply
    is one token; a question is picked whose reply token comes back unchanged in the next prompt
    (else the common prefix would stop before it anyway, and nothing would be tested)."""
    folder = checkpoint()
    li.load(folder)
    for question in ["Hello there", "Once upon a time", "The capital of France is", "def f(x):",
                     "Emoji 😀", "tabs\tand", "numbers 0123"]:
        ids1 = tokenizer.encode(li.chat_prompt([question])).ids
        reply = list(li.generate(ids1, max_tokens=1))
        ids2 = tokenizer.encode(li.chat_prompt([question, tokenizer.decode(reply), "And Japan?"])).ids
        if reply and ids2[:len(ids1) + 1] == ids1 + reply:
            break
    else:
        pytest.fail("no question's one-token reply comes back as the same token")
    r = run_cli("--model", str(folder), "--chat", "-m", "1", stdin=f"{question}\nAnd Japan?\n".encode())
    assert r.returncode == 0, r.stderr
    n = len(ids1) + 1  # the prompt and the reply's one token
    assert f"[KV cache: {n} tokens reused, {len(ids2) - n} new to prefill]" in r.stdout
    reply2 = "".join(piece for _, piece in li.stream_text(li.generate(ids2, max_tokens=1)))
    assert f"==========\n{reply2}\n==========" in r.stdout.split("[KV cache:")[2]  # turn 2's reply


def test_empty_line_ends_conversation(checkpoint):
    r = run_cli("--model", str(checkpoint()), "--chat", "-m", "3", stdin=b"Hi\n\nnever read\n")
    assert r.returncode == 0 and r.stdout.count("[KV cache:") == 1


def test_local_folder_never_downloads(tmp_path):
    (tmp_path / "org" / "name").mkdir(parents=True)  # looks like a repo id, but exists here
    for folder in (str(tmp_path / "org" / "name"), "org/name"):
        r = run_cli("--model", folder, env=dict(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf")),
                    cwd=tmp_path)
        assert_error(r, "lacks config.json")
        assert "could not download" not in r.stderr


# Issue 15: --explain, the KV cache's size (the logit lens: tests/test_lens.py).
@pytest.mark.parametrize("stop", ["max_tokens", "eos"])
def test_kv_cache_positions_and_bytes(checkpoint, tokenizer, capsys, stop):
    """generate() leaves the prompt and every id it yielded in the cache, whether it stopped at
    --max-tokens (the last id is run in too, lazily) or before an EOS id (not yielded, not held);
    reply()'s KV cache line counts exactly those. The bytes are the buffers' own: 3 layers x
    (keys + values) x 2 KV heads x 32 x 4 bytes."""
    ids = tokenizer.encode("The capital of France is").ids
    li.load(checkpoint())
    free_run = list(li.generate(ids, max_tokens=8))
    if stop == "eos":
        li.load(checkpoint(eos_extra=[free_run[5]]))
    cache, args = [None] * li.N_LAYERS, li.parse_args(["-m", "8"])
    generated = li.reply(ids, args, cache)
    held = len(ids) + len(generated)
    assert generated == free_run[:len(generated)] and len(generated) == (8 if stop == "max_tokens" else 5)
    fresh = [None] * li.N_LAYERS
    mx.eval(li.forward(ids + generated, fresh, 0))
    for (keys, values), (ref_keys, ref_values) in zip(cache, fresh):
        assert rel_err(keys[:, :held], ref_keys[:, :held]) < 1e-5        # really in it
        assert rel_err(values[:, :held], ref_values[:, :held]) < 1e-5
        if stop == "max_tokens":
            assert not mx.any(keys[:, held]).item()                       # nothing after it
    per_position = li.N_LAYERS * 2 * li.N_KV * li.D_HEAD * 4
    assert li.cache_bytes(cache, held) == held * per_position
    assert li.cache_bytes(cache) == sum(k.nbytes + v.nbytes for k, v in cache) == 256 * per_position
    shown = capsys.readouterr().out
    assert f"KV cache: {held} positions, {held * per_position / 1e6:.3f} MB " \
           f"({256 * per_position / 1e6:.3f} MB allocated)" in shown


def explained(stdout):
    """--explain's output before the answer -> (tokens line, embedding line, table rows)."""
    lines = stdout.split("\n==========\n")[0].split("\nwhere the last token looks")[0]
    lines = lines.splitlines()[1:]  # after the model summary, before where the token looks
    tokens, embedding, heading, *rest = lines
    assert tokens.startswith("tokens: ") and embedding.startswith("embedding: ")
    assert heading.startswith("the next token: the model's top ")
    return tokens, embedding, [parse_row(row) for row in rest]


@pytest.mark.parametrize("prompt", ["The capital of France is", "a", "日本の首都 😀 🇫🇷\nnew line"])
def test_explain_end_to_end(checkpoint, tokenizer, prompt):
    folder = checkpoint()
    ids = tokenizer.encode(prompt).ids
    r = run_cli("--model", str(folder), "--prompt", prompt, "--explain", "-m", "4")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    tokens, embedding, table = explained(r.stdout)
    assert tokens == "tokens: " + ", ".join(f"{tokenizer.decode([t], skip_special_tokens=False)!r} {t}"
                                            for t in ids)
    assert embedding == f"embedding: ({len(ids)}, 64)"
    assert len(table) == 5  # 5 rows when --show-probs gives no K
    li.load(folder)
    (token, _), = li.top_tokens(li.prefill(ids, [None] * li.N_LAYERS), 1)
    assert table[0][0] == tokenizer.decode([token], skip_special_tokens=False)
    grid = r.stdout.split("the answer forming")[1]  # the first column's top cell: that token
    assert re.search(r"\nblock 3 .(.+?)✓", grid)[1] == li.cell_text(token)
    assert "\nKV cache: " in r.stdout and "==========\n" + prompt in r.stdout
    if prompt == "a":
        assert len(ids) == 1


def test_explain_with_show_probs_k_and_in_a_conversation(checkpoint, tokenizer):
    folder = checkpoint()
    r = run_cli("--model", str(folder), "--prompt", "Once", "--explain", "--show-probs", "3", "-m", "2")
    assert r.returncode == 0 and len(explained(r.stdout)[2]) == 3
    r = run_cli("--model", str(folder), "--chat", "--explain", "-m", "3", stdin=b"Hello there\nAnd Japan?\n")
    assert r.returncode == 0, r.stderr
    turns = r.stdout.split("[KV cache: ")[1:]
    news = [int(re.match(r"(\d+) tokens reused, (\d+) new", turn)[2]) for turn in turns]
    for turn, new in zip(turns, news):  # each turn's walkthrough shows the tokens it computes
        tokens = explained("\n" + turn.split("\n", 1)[1])[0]
        assert len(re.findall(r"['\"] \d+(?=, |$)", tokens)) == new
        assert f"'<|im_start|>' {tokenizer.token_to_id('<|im_start|>')}, " in tokens  # shown by name
    held = [int(n) for n in re.findall(r"\nKV cache: (\d+) positions", r.stdout)]
    assert len(held) == 2 and held[0] < held[1]  # the cache grows turn by turn


# Issue 16: a conversation a person can hold in a terminal.
HINT = ("Type a message and press Enter; an empty line or Ctrl-D ends the chat; Ctrl-C stops an "
        "answer.")


def test_conversation_at_a_terminal_says_what_to_do(checkpoint):
    """Standard input is a terminal (a pseudo-terminal here): one hint on stderr before the
    first turn, and the ">> " prompt before each turn, the last one ended by Ctrl-D; the answers
    alone (tests/test_chat.py: --verbose)."""
    import pty
    leader, follower = pty.openpty()
    env = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, str(ROOT / "llm_inference.py"), "--model", str(checkpoint()),
                          "--chat", "-m", "3"], stdin=follower, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    os.close(follower)
    seen = b""
    for k, typed in enumerate([b"Hello there\n", b"And Japan?\n", b"\x04"], 1):  # Ctrl-D ends it
        while seen.count(b">> ") < k:  # the k-th prompt is up: type the k-th line
            ready, _, _ = select.select([p.stdout], [], [], 30)
            chunk = os.read(p.stdout.fileno(), 4096) if ready else b""
            if not chunk:  # ended, or silent for 30 s: no prompt came
                p.kill()
                pytest.fail(f"no prompt {k}: {seen!r}")
            seen += chunk
        os.write(leader, typed)
    out, err = p.communicate(timeout=60)
    os.close(leader)
    out = (seen + out).decode()
    assert p.returncode == 0, err
    assert err.decode().splitlines() == [HINT]
    assert out.count(">> ") == 3 and "[KV cache: " not in out  # a prompt before each turn


def test_conversation_through_a_pipe_has_no_hint_nor_prompt(checkpoint):
    r = run_cli("--model", str(checkpoint()), "--chat", "-m", "3", stdin=b"Hello there\nAnd Japan?\n")
    assert r.returncode == 0 and r.stderr == ""
    assert ">>" not in r.stdout and r.stdout.count("[KV cache: ") == 2


class TypedLines:
    """A stand-in for a terminal's standard input: isatty(), and the lines a person types."""
    def __init__(self, *lines):
        self.lines = list(lines)

    def isatty(self):
        return True

    def readline(self):
        return self.lines.pop(0) if self.lines else ""  # "": Ctrl-D


@pytest.mark.parametrize("lines", [["Hi\n", "\n"], ["Hi\n"]])  # an empty line ends it, or Ctrl-D
def test_a_terminal_chat_gives_the_callers_ctrl_c_handler_back(checkpoint, monkeypatch, lines):
    """converse() at a terminal lets Ctrl-C stop an answer while it runs; once the chat ends, the
    SIGINT handler is the caller's again (a notebook's, say)."""
    import signal
    li.load(checkpoint())
    during = []

    def mine(signum, frame):
        pass

    reply = li.reply

    def watched(*args, **kwargs):  # the handler while an answer runs
        during.append(signal.getsignal(signal.SIGINT))
        return reply(*args, **kwargs)

    monkeypatch.setattr(li, "reply", watched)
    monkeypatch.setattr(sys, "stdin", TypedLines(*lines))
    previous = signal.signal(signal.SIGINT, mine)
    try:
        li.converse(li.parse_args(["--chat", "-m", "2"]))
        assert during == [signal.default_int_handler]
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


def test_interruptible_off_the_main_thread_changes_nothing():
    """interruptible() called from another thread (a notebook's worker, say): Python lets only the
    main thread set a signal handler, so it sets none, raises nothing, and leaves the handler."""
    import signal
    import threading
    mine, seen = signal.getsignal(signal.SIGINT), []

    def work():
        try:
            with li.interruptible():
                seen.append(signal.getsignal(signal.SIGINT))
        except Exception as e:  # what the test reports, not a way out of the code under test
            seen.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [mine] and signal.getsignal(signal.SIGINT) is mine
