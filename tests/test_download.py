"""The first run, as a newcomer meets it, against a stand-in for the Hugging Face Hub on 127.0.0.1
(tests/hub.py; HF_ENDPOINT points there): the download's display at a terminal and through a pipe,
a second run that asks nothing, Ctrl-C during the download, a file damaged on the way, the Hub
answering an error or not at all, a repo id, and the hand commands the errors print."""
import fcntl
import os
import pty
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from tqdm import tqdm

from hub import StandInHub
from test_cli_errors import ROOT

FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "model.safetensors"]
SHARDED = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "model.safetensors.index.json", "model-00001-of-00002.safetensors",
           "model-00002-of-00002.safetensors"]


@pytest.fixture
def hub(checkpoint):
    """Qwen/Qwen3-0.6B (one weights file) and Qwen/Qwen3-1.7B (two shards), both tiny."""
    hub = StandInHub()
    hub.add_repo("Qwen/Qwen3-0.6B", checkpoint(), FILES)
    hub.add_repo("Qwen/Qwen3-1.7B", checkpoint(shards=2, seed=3), SHARDED)
    yield hub
    hub.close()


@pytest.fixture
def fresh_clone(tmp_path):
    """llm_inference.py alone in an empty folder, as in a fresh clone: no Qwen3-0.6B/ yet."""
    shutil.copy(ROOT / "llm_inference.py", tmp_path)
    return tmp_path


def environment(hub, home, **extra):
    return {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "PYTHONIOENCODING": "utf-8",
            "PYTHONUNBUFFERED": "1", **extra}


def run(folder, hub, *args, **extra):
    r = subprocess.run([sys.executable, str(folder / "llm_inference.py"), "-m", "3", *args],
                       env=environment(hub, folder / "hf", **extra), capture_output=True, timeout=120)
    r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()
    return r


def assert_error(r, *needles):
    """A failed run: non-zero exit, no traceback; on stderr the files that did arrive, one line
    each, then one line that says what went wrong, with each needle in it."""
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr
    *arrived, last = r.stderr.strip().splitlines()
    assert all(line.endswith(" downloaded") for line in arrived), r.stderr
    assert last.startswith("error: ")
    for needle in needles:
        assert needle in last, (needle, last)


def test_first_run_through_a_pipe_then_a_second_that_asks_nothing(hub, fresh_clone):
    r = run(fresh_clone, hub)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "\x1b" not in r.stderr  # a log, not a terminal: no redraws
    shown = r.stderr.splitlines()
    assert [line.split(":")[0] for line in shown] == FILES  # one line per file, as it completes
    assert all(re.fullmatch(r"[\w.]+: [\d.]+[kMG]?B downloaded", line) for line in shown), shown
    assert r.stdout.startswith("Qwen3 from ") and "Generation: 3 tokens" in r.stdout
    for name in FILES:
        assert (fresh_clone / "Qwen3-0.6B" / name).read_bytes() == hub.repos["Qwen/Qwen3-0.6B"][name]
    hub.requests.clear()
    again = run(fresh_clone, hub)
    assert again.returncode == 0 and again.stderr == "" and again.stdout == r.stdout.replace(
        r.stdout.split("Prompt: ")[1], again.stdout.split("Prompt: ")[1])
    assert hub.requests == []  # the folder is complete: the Hub is not asked


def screen(raw):
    """What a terminal shows of raw output: each line as its last redraw left it (\\r goes back
    to the line's start, \\x1b[K clears the rest of it)."""
    lines = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        lines.append(line.split("\r")[-1].replace("\x1b[K", "").rstrip())  # padding: unseen
    return [line for line in lines if line]


@pytest.mark.parametrize("columns", [100, 0])
def test_first_run_at_a_terminal(hub, fresh_clone, checkpoint, columns):
    """At a (pseudo-)terminal: the large file's line is redrawn with the bytes so far, the speed
    and the time left; each file ends on a line of its own, before the script's first line;
    nothing is printed after the statistics. (huggingface_hub reports every 10 MB: the weights
    here are 31 MB, arriving over 3 s.) A terminal that reports no size (0 columns, as some
    pseudo-terminals do) shows the same lines: tqdm alone would print them empty."""
    hub.add_repo("Qwen/Qwen3-0.6B", checkpoint(vocab_size=60000), FILES)
    hub.slow["model.safetensors"] = 3.0
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24 if columns else 0, columns, 0, 0))
    p = subprocess.Popen([sys.executable, str(fresh_clone / "llm_inference.py"), "-m", "3"],
                         stdin=follower, stdout=follower, stderr=follower,
                         env=environment(hub, fresh_clone / "hf"))
    os.close(follower)
    raw = b""
    while select.select([leader], [], [], 60)[0]:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # Linux: EIO once the child has closed the terminal
            break
        if not chunk:
            break
        raw += chunk
    p.wait(timeout=60)
    os.close(leader)
    text = raw.decode()
    assert p.returncode == 0, text
    frames = [f for f in text.split("\r") if f.startswith("model.safetensors: ") and "MB/s" in f]
    assert len(frames) >= 2 and re.search(r"[\d.]+MB / 31\.4MB, [\d.]+MB/s, 00:0\d left", frames[0])
    lines = screen(text)
    assert [line.split(":")[0] for line in lines[:5]] == FILES
    assert all(line.endswith(" downloaded") for line in lines[:5])  # no bar shares a line
    assert lines[5].startswith("Qwen3 from ")  # the script's own output follows, on its own line
    assert lines[-1].startswith("KV cache: ") and text.rstrip().endswith(lines[-1])  # nothing after


def test_ctrl_c_during_the_download(hub, fresh_clone):
    """Ctrl-C while the weights arrive: exit status 130, one line that says what to do, nothing
    left behind (huggingface_hub's partial file is removed); the next run downloads it whole."""
    hub.slow["model.safetensors"] = 1.5
    p = subprocess.Popen([sys.executable, str(fresh_clone / "llm_inference.py"), "-m", "3"],
                         env=environment(hub, fresh_clone / "hf"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    seen = b""
    while b"tokenizer_config.json:" not in seen:  # the file before the weights is complete
        chunk = os.read(p.stderr.fileno(), 4096)
        assert chunk, seen
        seen += chunk
    time.sleep(0.4)  # the weights are arriving
    assert any(request[1].endswith("model.safetensors") and request[0] == "GET" for request in hub.requests)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    err = (seen + err).decode()
    assert p.returncode == 130, err
    assert "Traceback" not in err and out == b""
    assert err.splitlines()[-1] == ("error: the download was interrupted; run the same command "
                                    "again to finish it")
    folder = fresh_clone / "Qwen3-0.6B"
    assert not (folder / "model.safetensors").exists()
    assert [f for f in folder.rglob("*") if f.name.endswith(".incomplete")] == []
    hub.slow.clear()
    r = run(fresh_clone, hub)
    size = tqdm.format_sizeof(len(hub.repos["Qwen/Qwen3-0.6B"]["model.safetensors"]))
    assert r.returncode == 0 and r.stderr.splitlines() == [f"model.safetensors: {size}B downloaded"]


def test_a_file_damaged_on_the_way(hub, fresh_clone):
    """Served with one byte changed, announced by the hash of the true bytes: the file is named,
    removed, exit status 1; the next run fetches it again, and it runs."""
    hub.corrupt.add("model.safetensors")
    r = run(fresh_clone, hub)
    path = fresh_clone / "Qwen3-0.6B" / "model.safetensors"
    assert_error(r, f"{path} is not the file the Hub announced", "damaged on the way, removed; run "
                 "again to fetch it")
    assert not path.exists() and r.stdout == ""
    hub.corrupt.clear()
    again = run(fresh_clone, hub)
    assert again.returncode == 0 and "Generation: 3 tokens" in again.stdout, again.stderr
    assert path.read_bytes() == hub.repos["Qwen/Qwen3-0.6B"]["model.safetensors"]


def hand_command(line):
    """The command an error line prints after "By hand: " (up to ", then")."""
    return shlex.split(line.split("By hand: ")[1].split(", then")[0])


def test_hub_not_reached_and_the_hand_command(hub, fresh_clone):
    """Nothing listens on the Hub's address: the line says so and prints the command that
    downloads the files by hand into the folder the script reads; run as printed (the Hub up),
    it does, and the script then runs without asking the Hub anything."""
    down = "http://127.0.0.1:9"  # the discard port: nothing listens on it
    r = run(fresh_clone, hub, HF_ENDPOINT=down)
    folder = fresh_clone / "Qwen3-0.6B"
    assert_error(r, f"could not download the file list of Qwen/Qwen3-0.6B: {down} could not "
                 "be reached", f"By hand: hf download Qwen/Qwen3-0.6B {' '.join(FILES)} --local-dir {folder}")
    command = hand_command(r.stderr)
    command[0] = str(Path(sys.executable).parent / "hf")  # the venv's, as `pip install` puts on PATH
    done = subprocess.run(command, env=environment(hub, fresh_clone / "hf"), capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    hub.requests.clear()
    r = run(fresh_clone, hub)
    assert r.returncode == 0 and "Generation: 3 tokens" in r.stdout and hub.requests == []


def test_offline(hub, fresh_clone):
    r = run(fresh_clone, hub, HF_HUB_OFFLINE="1")
    assert_error(r, "could not download the file list of Qwen/Qwen3-0.6B: offline: "
                 "HF_HUB_OFFLINE is set. By hand: hf download Qwen/Qwen3-0.6B")
    assert hub.requests == []


@pytest.mark.parametrize("name, status, answer", [("tokenizer.json", 404, "404 Not Found"),
                                                  ("model.safetensors", 500, "500 Internal Server Error")])
def test_the_hub_answers_an_error(hub, fresh_clone, name, status, answer):
    """The file and what the Hub answered. (A server error: huggingface_hub asks five more times,
    over about 23 s, before it gives up.)"""
    hub.status[name] = status
    r = run(fresh_clone, hub)
    assert_error(r, f"could not download {name} of Qwen/Qwen3-0.6B: the Hub answered {answer}. By hand: ")


def test_repo_id_into_the_cache_and_its_hand_command(hub, fresh_clone, checkpoint):
    """--model Qwen/Qwen3-1.7B: a sharded checkpoint into the Hugging Face cache; a second run asks
    nothing. Offline with an empty cache, the hand command fills that cache, and --model reads it."""
    r = run(fresh_clone, hub, "--model", "Qwen/Qwen3-1.7B")
    assert r.returncode == 0, r.stderr
    assert sorted(line.split(":")[0] for line in r.stderr.splitlines()) == sorted(SHARDED)
    reference = run(fresh_clone, hub, "--model", str(checkpoint(shards=2, seed=3)))
    assert r.stdout.split("==========")[1] == reference.stdout.split("==========")[1]
    hub.requests.clear()
    assert run(fresh_clone, hub, "--model", "Qwen/Qwen3-1.7B").returncode == 0 and hub.requests == []
    shutil.rmtree(fresh_clone / "hf")
    r = run(fresh_clone, hub, "--model", "Qwen/Qwen3-1.7B", HF_HUB_OFFLINE="1")
    assert_error(r, 'By hand: hf download Qwen/Qwen3-1.7B --include "*.json" --include '
                 '"*.jinja" --include "*.safetensors", then --model Qwen/Qwen3-1.7B')
    command = hand_command(r.stderr)
    command[0] = str(Path(sys.executable).parent / "hf")
    done = subprocess.run(command, env=environment(hub, fresh_clone / "hf"), capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    hub.requests.clear()
    r = run(fresh_clone, hub, "--model", "Qwen/Qwen3-1.7B")
    assert r.returncode == 0 and r.stderr == "" and hub.requests == []
