"""The chat as a person holds it at a terminal (issue 35): line editing and history at the ">> "
prompt (readline), Ctrl-C stops the answer and returns to the prompt with the conversation and its
cache consistent, the statistics only with --verbose. Everything through a pseudo-terminal, but
a Ctrl-C placed inside a drafted answer's verify pass and inside a Qwen3.5 turn's prefill
(in-process, the chat through a pipe)."""
import io
import math
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

import llm_inference as li
from test_cli_errors import HOLD_IN_PREFILL, ROOT, run_cli, save_weights


# Timeouts only bound a hang: a loaded machine may take minutes over a slow checkpoint's prefill.
TIMEOUT = 300


class Terminal:
    """The CLI with a pseudo-terminal as its standard input and output (readline then edits the
    line); stderr apart. read_until() waits for text on the screen, type() types. hook: Python
    code run in its place, given llm_inference.py's path and the flags (HOLD_IN_PREFILL)."""

    def __init__(self, *args, hook=None):
        self.leader, follower = pty.openpty()
        env = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1", TERM="xterm")
        start = [sys.executable] + (["-c", hook] if hook else [])
        self.p = subprocess.Popen([*start, str(ROOT / "llm_inference.py"), *args],
                                  stdin=follower, stdout=follower, stderr=subprocess.PIPE, env=env)
        os.close(follower)
        self.seen = b""

    def read_until(self, wanted, count=1, timeout=TIMEOUT, not_after=None):
        """not_after: text that, seen first, fails at once (wanted will not come)."""
        deadline = time.time() + timeout
        while self.seen.count(wanted) < count:
            if not_after and not_after in self.seen:
                self.p.kill()
                pytest.fail(f"saw {not_after!r} before {wanted!r}: {self.seen.decode(errors='replace')}")
            ready = select.select([self.leader], [], [], max(deadline - time.time(), 0))[0]
            try:
                chunk = os.read(self.leader, 65536) if ready else b""
            except OSError:  # the child closed the terminal
                chunk = b""
            if not chunk:
                self.p.kill()
                pytest.fail(f"never saw {wanted!r} x{count}: {self.seen.decode(errors='replace')}")
            self.seen += chunk

    def type(self, text):
        os.write(self.leader, text)

    def close(self):
        out, err = self.p.communicate(timeout=TIMEOUT)
        os.close(self.leader)
        return self.p.returncode, self.seen.decode().replace("\r\n", "\n"), err.decode()


def interrupt_then_ask(t):
    """Ctrl-C now, then the next turn "And Japan?" answered in full, then Ctrl-D -> stdout."""
    t.p.send_signal(signal.SIGINT)
    t.read_until(b">> ", 2)
    t.type(b"And Japan?\r")
    t.read_until(b"Peak memory")
    t.read_until(b">> ", 3)
    t.type(b"\x04")
    code, out, err = t.close()
    assert code == 0 and "Traceback" not in err, err
    return out


def test_line_editing_and_history(checkpoint, tokenizer):
    """The left arrow moves the cursor (the line sent is "aXb", not "ab^[[DX"); the up arrow
    brings back the line before. --explain shows each turn's token ids."""
    folder = checkpoint()
    t = Terminal("--model", str(folder), "--chat", "-m", "2", "--explain")
    t.read_until(b">> ")
    t.type(b"ab\x1b[DX\r")
    t.read_until(b">> ", 2)
    t.type(b"\x1b[A\r")  # the same line again
    t.read_until(b">> ", 3)
    t.type(b"\x04")
    code, out, err = t.close()
    assert code == 0, err
    li.load(folder)
    ids = tokenizer.encode(li.chat_prompt(["aXb"])).ids
    assert "tokens: " + ", ".join(f"{li.shown(i)} {i}" for i in ids) + "\n" in out
    again = tokenizer.encode(li.chat_prompt(["aXb", tokenizer.decode(list(li.generate(ids, 2))),
                                             "aXb"])).ids
    shown = re.findall(r"tokens: (.*)\n", out)[1]  # what turn 2 computes: its prompt past the cache
    assert ", ".join(f"{li.shown(i)} {i}" for i in again).endswith(shown) and "'X' 55, 'b'" in shown


def test_quiet_answers_at_a_terminal_and_verbose(checkpoint):
    """At a terminal the answers come alone, as in mlx_lm.chat; --verbose adds the statistics."""
    for flags, stats in [([], 0), (["--verbose"], 2)]:
        t = Terminal("--model", str(checkpoint()), "--chat", "-m", "3", *flags)
        for k, line in enumerate([b"Hello there\r", b"And Japan?\r", b"\x04"], 1):
            t.read_until(b">> ", k)
            t.type(line)
        code, out, err = t.close()
        assert code == 0 and "Traceback" not in err, err
        assert out.count("Peak memory") == out.count("[KV cache: ") == stats
        assert "==========" not in out or stats


def answer_pieces(ids, most):
    return [piece for _, piece in li.stream_text(li.generate(ids, max_tokens=most))]


@pytest.mark.parametrize("model", ["qwen3", "qwen35"])
def test_ctrl_c_stops_the_answer_and_the_next_turn_is_a_fresh_runs(checkpoint, qwen35, tokenizer,
                                                                  model):
    """Ctrl-C while the first answer streams: it stops, the prompt comes back, the chat goes on.
    The cache may hold a token more than was printed (generate() queues the next step before it
    yields), and Qwen3.5's DeltaNet state cannot be cut back: the next answer must still equal a
    fresh run (greedy, float32) of the conversation with the first answer as far as it came."""
    folder = checkpoint() if model == "qwen3" else qwen35(tied=False)
    li.load(folder)
    for line in ["Hello there", "Once upon a time", "def f(x):", "Emoji 😀", "numbers 0123"]:
        ids1 = tokenizer.encode(li.chat_prompt([line])).ids
        full = list(li.generate(ids1, max_tokens=1500))
        if len(full) >= 300:  # long enough to be stopped on the way
            break
    else:
        pytest.fail("no line has a long answer")
    pieces = answer_pieces(ids1, 1500)
    t = Terminal("--model", str(folder), "--chat", "-m", "1500", "--verbose", "--think")  # as ids1
    t.read_until(b">> ")
    t.type(line.encode() + b"\r")
    t.read_until(b"==========\r\n")
    time.sleep(0.3)  # part of the answer is on the screen
    out = interrupt_then_ask(t)
    first, rest = out.split("==========\n", 1)[1].split("\n>> ", 1)
    assert "Peak memory" not in first and "Peak memory" in rest  # the first answer stopped
    second = rest.split("==========\n", 1)[1].split("\n==========")[0]
    cuts = [k for k in range(1, len(full)) if "".join(pieces[:k]) == first]
    assert cuts and len(full) > cuts[-1], "interrupted after the whole answer"
    expected = [answer_pieces(tokenizer.encode(li.chat_prompt(
        [line, tokenizer.decode(full[:k]), "And Japan?"])).ids, 1500) for k in cuts]
    assert second in ["".join(p) for p in expected]


def test_ctrl_c_during_a_turns_prefill(checkpoint, tokenizer):
    """Ctrl-C while a long line is prefilled: no answer, the prompt comes back, and the next
    answer equals a fresh run of the conversation (that turn's answer empty): the cache is
    trusted only as far as it was before the interrupted prefill. The Ctrl-C comes once the
    prefill's first step is in the cache (HOLD_IN_PREFILL), not after a sleep that a fast machine
    outruns (the prefill over) or a loaded one undershoots."""
    long = "The capital of France is Paris. " * 10  # ~100 tokens: steps of STEP (32) at a terminal
    folder = checkpoint()
    t = Terminal("--model", str(folder), "--chat", "-m", "5", "--verbose", hook=HOLD_IN_PREFILL)
    t.read_until(b">> ")
    t.type(long.encode() + b"\r")
    t.read_until(b"[test: a prefill step is in the cache", not_after=b"==========")
    out = interrupt_then_ask(t)
    first, second = out.split("[KV cache: ")[1:]
    assert "[test: Ctrl-C in the prefill]" in first and "==========" not in first  # stopped inside
    li.load(folder)
    ids = tokenizer.encode(li.chat_prompt([long, "", "And Japan?"])).ids
    assert second.split("==========\n")[1] == "".join(answer_pieces(ids, 5)) + "\n"


def test_ctrl_c_at_the_prompt_ends_the_chat(checkpoint):
    """At the ">> " prompt (no answer to stop) Ctrl-C ends the chat, as it ends a shell command:
    exit status 130, no traceback."""
    t = Terminal("--model", str(checkpoint()), "--chat", "-m", "3")
    t.read_until(b">> ")
    t.type(b"Hello there\r")
    t.read_until(b">> ", 2)
    time.sleep(0.3)
    t.p.send_signal(signal.SIGINT)
    code, out, err = t.close()
    assert code == 130 and "Traceback" not in err, err


@pytest.mark.parametrize("k", [2, 3])
def test_ctrl_c_while_drafting_and_the_next_turn_is_a_fresh_runs(checkpoint, tokenizer, monkeypatch,
                                                                  capsys, k):
    """Ctrl-C in the k-th verify pass of a drafted answer (--draft lookup): the ids printed so far
    may not all be in the cache yet, so converse() trusts it only short of the last one. The next
    answer must equal a fresh greedy run of the conversation with the first answer as printed."""
    folder = checkpoint()
    li.load(folder)
    replies, calls, verify_pass, plain_reply = [], [], li.verify_pass, li.reply

    def reply(*args, **kwargs):  # each turn's list of printed ids, kept to compare
        replies.append(kwargs["generated"])
        return plain_reply(*args, **kwargs)

    def interrupted(*args, **kwargs):  # the k-th pass of the first turn: Ctrl-C
        calls.append(1)
        if len(replies) == 1 and len(calls) == k:
            raise KeyboardInterrupt
        return verify_pass(*args, **kwargs)

    monkeypatch.setattr(li, "reply", reply)
    monkeypatch.setattr(li, "verify_pass", interrupted)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello there\nAnd Japan?\n")))
    li.converse(li.parse_args(["--model", str(folder), "--chat", "--draft", "lookup", "-m", "20"]))
    capsys.readouterr()
    first, second = replies
    assert 0 < len(first) < 20  # stopped on the way
    ids = tokenizer.encode(li.chat_prompt(["Hello there", li.TOK.decode(first), "And Japan?"])).ids
    assert second == list(li.generate(ids, max_tokens=20))


def remembering(folder, into):
    """A copy of a Qwen3.5 checkpoint whose DeltaNet heads keep 99% of their state a token
    (A_log = log 0.01), as a trained model's slow heads do: the fixture's own (A from 1 to 16)
    forget within a few tokens, so that a state left from before would be gone by a prompt's end."""
    into = Path(shutil.copytree(folder, into))
    weights = mx.load(str(into / "model.safetensors"))
    for name in [name for name in weights if name.endswith("A_log")]:
        weights[name] = mx.full(weights[name].shape, math.log(0.01), mx.float32)
    save_weights(into / "model.safetensors", weights, metadata={"format": "pt"})
    return into


@pytest.mark.parametrize("turn", [1, 2])
def test_a_qwen35_turn_that_cannot_reuse_its_cache_starts_afresh(qwen35, tmp_path, monkeypatch, capsys,
                                                                turn):
    """A Qwen3.5 chat through a pipe whose turn-th prefill is interrupted (KeyboardInterrupt, as
    Ctrl-C raises it at a terminal) after its first step is in the cache, before the mark where the
    cache is kept: nothing was kept at the mark, so the next turn cannot reuse the cache (a
    DeltaNet's notes cannot be cut back) and must start from a fresh state, not go on from the
    interrupted prefill's (or, for turn 2, the first turn's). Its answer must equal a fresh greedy
    run of the conversation with that turn's answer empty. The model's DeltaNet remembers (a state
    left from before changes the answer: measured, from its first or second id)."""
    folder = remembering(qwen35(tied=False), tmp_path / "remembering")
    li.load(folder)
    lines = ["Hello there", "Once upon a time", "And Japan?"][:turn + 1]
    replies, calls, forward, plain_reply = [], [], li.forward, li.reply

    def reply(*args, **kwargs):  # each turn's list of printed ids, kept to compare
        replies.append(kwargs["generated"])
        calls.clear()
        return plain_reply(*args, **kwargs)

    def interrupted(token_ids, cache, start, *args):  # the turn-th turn's second model pass: Ctrl-C
        calls.append(start)
        if len(replies) == turn and len(calls) == 2:
            raise KeyboardInterrupt
        return forward(token_ids, cache, start, *args)

    monkeypatch.setattr(li, "reply", reply)
    monkeypatch.setattr(li, "forward", interrupted)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("".join(
        line + "\n" for line in lines).encode())))
    li.converse(li.parse_args(["--model", str(folder), "--chat", "-m", "8"]))
    capsys.readouterr()
    assert len(replies) == turn + 1 and replies[turn - 1] == [], replies  # stopped in the prefill
    turns = [text for line, ids in zip(lines, replies) for text in (line, li.TOK.decode(ids))]
    ids = li.tokenize(li.chat_prompt(turns[:-1]))
    assert replies[-1] == list(li.generate(ids, max_tokens=8))


class TerminalInput(io.TextIOWrapper):
    """Standard input as a terminal for converse(): isatty(), and input() given these lines."""
    def isatty(self):
        return True


def typed(monkeypatch, lines):  # converse() at a terminal, the person typing lines, then Ctrl-D
    monkeypatch.setattr(sys, "stdin", TerminalInput(io.BytesIO(b"")))
    answers = iter(lines)

    def read(prompt=""):
        try:
            return next(answers)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", read)


def test_converse_leaves_the_callers_args_as_they_were(checkpoint, monkeypatch, capsys):
    """At a terminal the answers come alone (quiet): converse() makes that so for its own turns,
    and the args it was given are as they were after it (a notebook's, say)."""
    args = li.parse_args(["--model", str(checkpoint()), "--chat", "-m", "2"])
    li.load(args.model)
    before = dict(vars(args))
    typed(monkeypatch, ["Hello there"])
    li.converse(args)
    assert "Peak memory" not in capsys.readouterr().out  # quiet, as mlx_lm.chat
    assert vars(args) == before


@pytest.mark.parametrize("draft", [None, "lookup", "mtp"])
@pytest.mark.parametrize("at_terminal", [True, False])
def test_a_chats_passes_take_step_tokens_at_a_terminal(checkpoint, qwen35, monkeypatch, capsys,
                                                       draft, at_terminal):
    """At a terminal every pass of the model over a turn's prompt takes at most STEP tokens, so
    that Ctrl-C takes effect within a few tokens, --draft's passes too (the MTP head's reading of
    the prompt among them); through a pipe, a long prompt goes CHUNK at a time."""
    folder = qwen35(mtp="agree") if draft == "mtp" else checkpoint()
    line = "The capital of France is Paris. " * 12  # ~100 tokens
    lengths, forward, mtp_logits = [], li.forward, li.mtp_logits

    def counted(token_ids, *args):
        lengths.append(len(token_ids))
        return forward(token_ids, *args)

    def mtp_counted(tokens, *args):
        lengths.append(len(tokens))
        return mtp_logits(tokens, *args)

    monkeypatch.setattr(li, "forward", counted)
    monkeypatch.setattr(li, "mtp_logits", mtp_counted)
    args = li.parse_args(["--model", str(folder), "--chat", "-m", "2"] +
                         (["--draft", draft] if draft else []))
    li.load(folder)
    if at_terminal:
        typed(monkeypatch, [line])
    else:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(line.encode() + b"\n")))
    li.converse(args)
    capsys.readouterr()
    assert len(li.tokenize(line)) > 3 * li.STEP
    if at_terminal:
        assert max(lengths) <= li.STEP, lengths
    else:
        assert max(lengths) > li.STEP, lengths


def test_each_answers_peak_memory_is_its_own(checkpoint):
    """A chat through a pipe with --explain: the second answer's peak is its own, not the first
    answer's --explain probe's 268 MB (the model here is a megabyte)."""
    r = run_cli("--model", str(checkpoint()), "--chat", "--explain", "-m", "3",
                stdin=b"Hello there\nAnd Japan?\n")
    peaks = [float(p) for p in re.findall(r"Peak memory: ([\d.]+) GB", r.stdout)]
    assert r.returncode == 0 and len(peaks) == 2, r.stderr
    assert peaks[1] < 0.1, peaks
