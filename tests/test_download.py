"""The first run, as a newcomer meets it, against a stand-in for the Hugging Face Hub on 127.0.0.1
(tests/hub.py; HF_ENDPOINT points there): the download's display at a terminal and through a pipe,
a second run that asks nothing, Ctrl-C during the download, a file damaged on the way, the Hub
answering an error or not at all, a repo id, and the hand commands the errors print. Where the
behaviour is meant to be the same, on both paths the Hub serves a file by: plain HTTP, and Xet
storage (the real Hub's, for its large files), which huggingface_hub reads through hf_xet."""
import fcntl
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
import zlib
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


def stand_in(checkpoint, xet):
    """Qwen/Qwen3-0.6B (one weights file) and Qwen/Qwen3-1.7B (two shards), both tiny; on Xet
    storage (their *.safetensors), or plain."""
    hub = StandInHub(xet=xet)
    hub.add_repo("Qwen/Qwen3-0.6B", checkpoint(), FILES)
    hub.add_repo("Qwen/Qwen3-1.7B", checkpoint(shards=2, seed=3), SHARDED)
    return hub


@pytest.fixture(params=["plain", "xet"])
def hub(request, checkpoint):  # each test that takes it: on both paths
    hub = stand_in(checkpoint, request.param == "xet")
    yield hub
    hub.close()


@pytest.fixture
def plain_hub(checkpoint):
    hub = stand_in(checkpoint, False)
    yield hub
    hub.close()


@pytest.fixture
def xet_hub(checkpoint):
    hub = stand_in(checkpoint, True)
    yield hub
    hub.close()


def xet_path_taken(hub, name="model.safetensors"):
    """The file came from Xet storage: its reconstruction and xorbs asked, never a plain GET."""
    paths = [path for method, path, _ in hub.requests if method == "GET"]
    return any(path.startswith("/v2/reconstructions/") for path in paths) and \
        any(path.startswith("/xorbs/") and path.endswith(name) for path in paths) and \
        not any("/resolve/" in path and path.endswith(name) for path in paths)


@pytest.fixture
def fresh_clone(tmp_path):
    """llm_inference.py alone in an empty folder, as in a fresh clone: no Qwen3-0.6B/ yet."""
    shutil.copy(ROOT / "llm_inference.py", tmp_path)
    return tmp_path


# huggingface_hub waits 1, 2, 4, 8 and 8 s between its tries, and no setting changes that: in
# the child its waits are a hundredth as long (what it prints, "Retrying in 1s", stays), so a
# test of its five retries takes a second, not 23. (A huggingface_hub that moved its module: its
# own waits, slower, nothing else changed.)
FAST_RETRIES = """import time, types
try:
    import huggingface_hub.utils._http as http
except ImportError:
    http = None
def sleep(seconds):
    time.sleep(seconds / 100)
if getattr(http, "time", None) is time:
    http.time = types.SimpleNamespace(**vars(time))
    http.time.sleep = sleep
"""


def environment(hub, home, site="", **extra):
    """The child's: the stand-in, a Hugging Face home of its own, no telemetry asked; hf_xet's
    retries 0.1 s apart (its default, 3 s, grows to minutes), as a user may set; huggingface_hub's
    as FAST_RETRIES has them. site: more Python for the child's sitecustomize.py."""
    folder = Path(home).parent / f"site-{zlib.crc32(site.encode())}"  # one a text
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(FAST_RETRIES + site)
    return {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "PYTHONIOENCODING": "utf-8",
            "PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONPATH": str(folder),
            "HF_XET_CLIENT_RETRY_BASE_DELAY": "100ms", **extra}


def run(folder, hub, *args, **extra):
    r = subprocess.run([sys.executable, str(folder / "llm_inference.py"), "-m", "3", *args],
                       env=environment(hub, folder / "hf", **extra), capture_output=True, timeout=120)
    r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()
    return r


def assert_error(r, *needles):
    """A failed run: non-zero exit, no traceback, nothing on stdout; on stderr the lines of what was
    tried (each file announced, huggingface_hub's retries), then one line that says what went
    wrong, with each needle in it."""
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr and r.stdout == ""
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ")
    for needle in needles:
        assert needle in last, (needle, last)


def hand_command(line):
    """The shell command an error line ends with, after "then the same command again: "."""
    return line.strip().splitlines()[-1].split("then the same command again: ")[1]


def run_by_hand(command, hub, home):
    """The printed command, pasted whole into a shell, with the venv's `hf` on PATH."""
    env = environment(hub, home, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    done = subprocess.run(command, shell=True, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_first_run_through_a_pipe_then_a_second_that_asks_nothing(hub, fresh_clone):
    r = run(fresh_clone, hub)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "\x1b" not in r.stderr  # a log, not a terminal: no redraws
    first, *shown = r.stderr.splitlines()
    folder = fresh_clone / "Qwen3-0.6B"
    assert first == f"Qwen/Qwen3-0.6B: asking {hub.url} which files to fetch into {folder}"
    assert [line.split(":")[0] for line in shown] == FILES  # one line per file, before it comes
    folder = fresh_clone / "Qwen3-0.6B"
    assert all(re.fullmatch(rf"[\w.]+: [\d.]+[kMG]?B from {hub.url}/Qwen/Qwen3-0.6B into {folder}",
                            line) for line in shown), shown
    assert r.stdout.startswith("Qwen3 from ") and "Generation: 3 tokens" in r.stdout
    for name in FILES:
        assert (fresh_clone / "Qwen3-0.6B" / name).read_bytes() == hub.repos["Qwen/Qwen3-0.6B"][name]
    assert xet_path_taken(hub) == bool(hub.cas_url)
    hub.requests.clear()
    again = run(fresh_clone, hub)
    assert again.returncode == 0 and again.stderr == "" and again.stdout == r.stdout.replace(
        r.stdout.split("Prompt: ")[1], again.stdout.split("Prompt: ")[1])
    assert hub.requests == []  # the folder is complete: the Hub is not asked


def screen(raw):
    """What a terminal shows of raw output, line by line: text is written where the cursor is,
    \n goes to the next line's start, \r to this line's, \x1b[A one line up, \x1b[K clears the
    rest of the line; empty lines and trailing spaces (padding, unseen) left out."""
    lines, row, col = [""], 0, 0
    for token in re.split(r"(\r\n|\n|\r|\x1b\[A|\x1b\[K)", raw):
        if token in ("\r\n", "\n"):
            row, col = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif token == "\r":
            col = 0
        elif token == "\x1b[A":
            row = max(row - 1, 0)
        elif token == "\x1b[K":
            lines[row] = lines[row][:col]
        elif token:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + len(token):]
            col += len(token)
    return [line.rstrip() for line in lines if line.strip()]


RUN_BOUND = 300  # seconds a run at a terminal may take before it is killed and the test fails


def at_a_terminal(fresh_clone, hub, columns=100):
    """The first run with a (pseudo-)terminal of that many columns as its stdin, stdout and
    stderr -> its exit status, and all it wrote there: read until it closes the terminal, however
    long it is silent (what the test sees never ends at a pause); a run still going after
    RUN_BOUND s is killed, and the test fails saying so, with what it wrote."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24 if columns else 0, columns, 0, 0))
    p = subprocess.Popen([sys.executable, str(fresh_clone / "llm_inference.py"), "-m", "3"],
                         stdin=follower, stdout=follower, stderr=follower,
                         env=environment(hub, fresh_clone / "hf"))
    os.close(follower)
    raw, deadline = b"", time.monotonic() + RUN_BOUND
    try:
        while select.select([leader], [], [], max(deadline - time.monotonic(), 0))[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # Linux: EIO once the child has closed the terminal
                break
            if not chunk:
                break
            raw += chunk
        p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        pytest.fail(f"still running after {RUN_BOUND} s; at the terminal so far:\n"
                    + raw.decode(errors="replace"))
    finally:
        os.close(leader)
    return p.returncode, raw.decode()


@pytest.mark.parametrize("columns", [100, 0])
def test_first_run_at_a_terminal(plain_hub, fresh_clone, checkpoint, columns):
    """At a (pseudo-)terminal: each file's line, then huggingface_hub's own bar for it, redrawn
    with the bytes so far and the speed, left on a line of its own before the script's first line;
    nothing is printed after the statistics. (huggingface_hub reports every 10 MB: the weights
    here are 31 MB, arriving over 3 s.) A terminal that reports 0 columns (some pseudo-terminals)
    gets the files' lines without bars."""
    hub = plain_hub
    hub.add_repo("Qwen/Qwen3-0.6B", checkpoint(vocab_size=60000), FILES)
    hub.slow["model.safetensors"] = 3.0
    code, text = at_a_terminal(fresh_clone, hub, columns)
    assert code == 0, text
    if not columns:
        assert [line.split(":")[0] for line in screen(text)[1:6]] == FILES and "%|" not in text
        return
    frames = [f for f in text.split("\r") if "model.safetensors: " in f and "MB/s" in f]
    assert len(frames) >= 2 and re.search(r"[\d.]+M/31\.4M \[00:0\d<00:0\d, [\d.]+MB/s\]", frames[0])
    lines = screen(text)
    assert lines[0].startswith("Qwen/Qwen3-0.6B: asking ")  # before the first request
    assert [line.split(":")[0] for line in lines[1:11:2]] == FILES  # each file's line, its bar
    assert all(f"/{name}: 100%" in bar for name, bar in zip(FILES, lines[2:11:2])), lines
    assert lines[11].startswith("Qwen3 from ")  # the script's own output follows, on its own line
    assert lines[-1].startswith("Bytes per token: ") and text.rstrip().endswith(lines[-1])


def test_xet_at_a_terminal_a_bar_never_shows_whole_a_file_that_did_not_come(xet_hub, fresh_clone,
                                                                          checkpoint):
    """Xet storage at a terminal: each file's line, then one bar for it: the weights' counts the
    bytes written (huggingface_hub's second bar, of the bytes received, which it draws whole when
    the download ends, arrived or not, is not drawn); nothing after the statistics. When the
    connection breaks at 15 MB every time, the weights' bar stays where the file stopped (short
    of 100%: how far depends on the machine's load), and the last line says why."""
    hub = xet_hub
    hub.add_repo("Qwen/Qwen3-0.6B", checkpoint(vocab_size=60000), FILES)
    hub.slow["model.safetensors"] = 3.0
    code, text = at_a_terminal(fresh_clone, hub)
    assert code == 0 and xet_path_taken(hub), text
    lines = screen(text)
    assert [line.split(":")[0] for line in lines[1:11:2]] == FILES  # each file's line, its bar
    assert lines[10].startswith("model.safetensors: reconstructing file: 100%|"), lines
    assert "downloading bytes" not in text and lines[11].startswith("Qwen3 from ")
    assert lines[-1].startswith("Bytes per token: ") and text.rstrip().endswith(lines[-1])
    shutil.rmtree(fresh_clone / "Qwen3-0.6B")
    hub.reset["model.safetensors"] = (15_000_000, 99)
    code, text = at_a_terminal(fresh_clone, hub)
    lines = screen(text)
    assert code == 1 and "downloading bytes" not in text, text
    # Where the bar stops depends on how much of the file was written when the break came (at 15
    # MB received of 31.4; under load as little as 7% was written): any share but a whole bar.
    assert re.match(r"model\.safetensors: reconstructing file: +\d{1,2}%\|", lines[-2]), lines
    assert lines[-1].startswith("error: could not download model.safetensors of Qwen/Qwen3-0.6B: "
                                "the connection to Xet storage broke or stalled")


def test_ctrl_c_during_the_download(hub, fresh_clone):
    """Ctrl-C while the weights arrive: exit status 130 at once, one line that names the file and
    what a rerun does (the file's line before it); no file under a final name, no partial file left
    (huggingface_hub removes its own); the next run fetches that file again, from the start.
    At once: the file takes a minute to come, the process ends within communicate()'s bound."""
    hub.slow["model.safetensors"] = 60.0
    p = subprocess.Popen([sys.executable, str(fresh_clone / "llm_inference.py"), "-m", "3"],
                         env=environment(hub, fresh_clone / "hf"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not any(r[0] == "GET" and r[1].endswith("model.safetensors") for r in hub.requests):
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.05)
    time.sleep(0.5)  # the weights are arriving
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    err = err.decode()
    assert p.returncode == 130, err
    assert "Traceback" not in err and out == b""
    assert err.strip().splitlines()[-1] == (
        "error: the download was interrupted during model.safetensors; run the same command "
        "again: it keeps the files already complete and fetches the rest (a file begun, from its "
        "start)")
    folder = fresh_clone / "Qwen3-0.6B"
    assert not (folder / "model.safetensors").exists()
    assert [f for f in folder.rglob("*") if f.name.endswith(".incomplete")] == []
    hub.slow.clear()
    hub.requests.clear()
    r = run(fresh_clone, hub)
    size = tqdm.format_sizeof(len(hub.repos["Qwen/Qwen3-0.6B"]["model.safetensors"]))
    assert r.returncode == 0 and len(r.stderr.splitlines()) == 2
    assert r.stderr.splitlines()[1].startswith(f"model.safetensors: {size}B from ")
    if hub.cas_url:  # Xet storage: the file again from its first bytes (hf_xet keeps no part)
        assert xet_path_taken(hub) and any(rng.startswith("bytes=0-") for method, path, rng
                                           in hub.requests if path.startswith("/xorbs/"))
    else:
        assert {r[1].split("/")[-1] for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]} \
            == {"model.safetensors"}


@pytest.mark.parametrize("fault", ["corrupt", "lie"])
def test_a_file_damaged_on_the_way(hub, fresh_clone, fault):
    """Served with one byte changed (corrupt), or the true bytes announced by a wrong hash (lie):
    huggingface_hub's checksums disagree; the file is named, removed, exit status 1, nothing runs;
    the next run (the fault gone) fetches it again, and it runs."""
    getattr(hub, fault).add("model.safetensors")
    r = run(fresh_clone, hub)
    path = fresh_clone / "Qwen3-0.6B" / "model.safetensors"
    assert_error(r, f"{path} is not the file the Hub announced (sha256 ", "damaged on the way, "
                 "removed; run again to fetch it")
    assert not path.exists()
    getattr(hub, fault).clear()
    again = run(fresh_clone, hub)
    assert again.returncode == 0 and "Generation: 3 tokens" in again.stdout, again.stderr
    assert path.read_bytes() == hub.repos["Qwen/Qwen3-0.6B"]["model.safetensors"]


NO_LOOKUP = """import socket
def refuse(*args, **kwargs):
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (a test: no network)")
socket.getaddrinfo = refuse
"""


def test_no_network_shows_itself_and_the_hand_command(xet_hub, fresh_clone):
    """No network (every name lookup fails inside the process): before any wait a line shows what
    is tried, each retry of huggingface_hub's too; the last line says the Hub could not be reached
    and prints the command that downloads the files by hand into the folder the script reads;
    run as printed (the Hub up, its weights on Xet storage), it does, and the script then runs
    without asking the Hub. (Nothing reaches Xet storage first: the plain path would be the same,
    huggingface_hub's retries again.)"""
    hub = xet_hub
    env = environment(hub, fresh_clone / "hf", NO_LOOKUP, HF_ENDPOINT="https://huggingface.co")
    p = subprocess.Popen([sys.executable, str(fresh_clone / "llm_inference.py"), "-m", "3"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stderr.readline().decode()
    # Not silent: what is tried, before huggingface_hub's first try and wait.
    assert first.startswith("Qwen/Qwen3-0.6B: asking https://huggingface.co which files"), first
    out, err = p.communicate(timeout=120)
    r = subprocess.CompletedProcess(p.args, p.returncode, out.decode(), first + err.decode())
    assert r.stderr.count("Retry ") >= 3, r.stderr  # each retry shows
    folder = fresh_clone / "Qwen3-0.6B"
    assert_error(r, "could not download the file list of Qwen/Qwen3-0.6B: the Hub could not be "
                 "reached at https://huggingface.co")
    assert hand_command(r.stderr) == f"hf download Qwen/Qwen3-0.6B {' '.join(FILES)} --local-dir {folder}"
    run_by_hand(hand_command(r.stderr), hub, fresh_clone / "hf")
    hub.requests.clear()
    r = run(fresh_clone, hub)
    assert r.returncode == 0 and "Generation: 3 tokens" in r.stdout and hub.requests == []


def test_offline(hub, fresh_clone):
    r = run(fresh_clone, hub, HF_HUB_OFFLINE="1")
    assert_error(r, "could not download the file list of Qwen/Qwen3-0.6B: offline: "
                 "HF_HUB_OFFLINE is set. To fetch it by hand, run this, then the same command "
                 "again: hf download Qwen/Qwen3-0.6B")
    assert hub.requests == []


@pytest.mark.parametrize("path, name, status, answer", [
    ("plain", "tokenizer.json", 404, "404 Not Found"), ("xet", "model.safetensors", 404, "404 Not Found"),
    ("plain", "model.safetensors", 500, "500 Internal Server Error")])
def test_the_hub_answers_an_error(checkpoint, fresh_clone, path, name, status, answer):
    """The file and what the Hub answered, where it resolves the file's name, before any storage.
    (A server error: huggingface_hub asks five more times before it gives up: on the plain path
    only, the Xet one's would be the same.)"""
    hub = stand_in(checkpoint, path == "xet")
    hub.status[name] = status
    r = run(fresh_clone, hub)
    hub.close()
    assert_error(r, f"could not download {name} of Qwen/Qwen3-0.6B: the Hub answered {answer}. To "
                 "fetch it by hand")


def test_repo_id_into_the_cache_and_its_hand_command(hub, fresh_clone, checkpoint):
    """--model Qwen/Qwen3-1.7B: a sharded checkpoint into the Hugging Face cache; a second run asks
    nothing. Offline with an empty cache, the hand command fills that cache, and --model reads it."""
    r = run(fresh_clone, hub, "--model", "Qwen/Qwen3-1.7B")
    assert r.returncode == 0, r.stderr
    assert sorted(line.split(":")[0] for line in r.stderr.splitlines()[1:]) == sorted(SHARDED)
    reference = run(fresh_clone, hub, "--model", str(checkpoint(shards=2, seed=3)))
    assert r.stdout.split("==========")[1] == reference.stdout.split("==========")[1]
    hub.requests.clear()
    assert run(fresh_clone, hub, "--model", "Qwen/Qwen3-1.7B").returncode == 0 and hub.requests == []
    shutil.rmtree(fresh_clone / "hf")
    r = run(fresh_clone, hub, "--model", "Qwen/Qwen3-1.7B", HF_HUB_OFFLINE="1")
    assert_error(r, "offline: HF_HUB_OFFLINE is set")
    assert hand_command(r.stderr) == ('hf download Qwen/Qwen3-1.7B --include "*.json" --include '
                                      '"*.jinja" --include "*.safetensors"')
    run_by_hand(hand_command(r.stderr), hub, fresh_clone / "hf")
    hub.requests.clear()
    r = run(fresh_clone, hub, "--model", "Qwen/Qwen3-1.7B")
    assert r.returncode == 0 and r.stderr == "" and hub.requests == []


def tried_again(n):
    """The line a reset weights file's try number n (2 to 5) shows before it starts."""
    return f"model.safetensors: the connection broke; trying again from its start ({n} of 5)"


@pytest.mark.parametrize("times", [1, 2])
def test_a_connection_reset_mid_file_is_tried_again(plain_hub, fresh_clone, times):
    """The connection reset (TCP RST) after 300 kB of the weights, once or twice: the same run
    fetches the file again, a line for each new try, and runs. huggingface_hub keeps no partial
    file to resume from, so each try asks for the whole file (no Range)."""
    hub = plain_hub
    hub.reset["model.safetensors"] = (300_000, times)
    r = run(fresh_clone, hub)
    assert r.returncode == 0 and "Generation: 3 tokens" in r.stdout, r.stderr
    lines = r.stderr.splitlines()
    assert [line for line in lines if "trying again" in line] == \
        [tried_again(n) for n in range(2, times + 2)]
    assert lines[-1] == tried_again(times + 1) and lines[-2].startswith("model.safetensors: ")
    assert hub.resets_done["model.safetensors"] == times
    gets = [r for r in hub.requests if r[0] == "GET" and r[1].endswith("/model.safetensors")]
    assert gets == [("GET", "/Qwen/Qwen3-0.6B/resolve/main/model.safetensors", None)] * (times + 1)
    folder = fresh_clone / "Qwen3-0.6B"
    assert (folder / "model.safetensors").read_bytes() == \
        hub.repos["Qwen/Qwen3-0.6B"]["model.safetensors"]
    assert [f for f in folder.rglob("*") if f.name.endswith(".incomplete")] == []


@pytest.mark.parametrize("fault", ["reset", "close_early"])
def test_a_connection_that_breaks_mid_file(plain_hub, fresh_clone, fault):
    """The connection reset (TCP RST) or closed (FIN) after 300 kB of the weights, every time:
    a reset one is tried again, 5 tries in all, and huggingface_hub resumes a closed one a few
    times, each try shown; then one line names the file and the cause, and no part of the file
    is kept."""
    hub = plain_hub
    getattr(hub, fault)["model.safetensors"] = (300_000, 99) if fault == "reset" else 300_000
    r = run(fresh_clone, hub)
    assert_error(r, "could not download model.safetensors of Qwen/Qwen3-0.6B: the connection broke "
                 "before the Hub's answer was whole. To fetch it by hand")
    if fault == "reset":
        assert [line for line in r.stderr.splitlines() if "trying again" in line] == \
            [tried_again(n) for n in range(2, 6)]
        assert hub.resets_done["model.safetensors"] == 5
    else:
        assert r.stderr.count("Trying to resume download...") >= 3
        assert "trying again" not in r.stderr  # huggingface_hub's own retries, none of ours
    folder = fresh_clone / "Qwen3-0.6B"
    assert not (folder / "model.safetensors").exists()
    assert [f for f in folder.rglob("*") if f.name.endswith(".incomplete")] == []


def test_a_stall_mid_file_times_out(plain_hub, fresh_clone):
    """The Hub stops sending in the middle of the weights: huggingface_hub waits
    HF_HUB_DOWNLOAD_TIMEOUT seconds, resumes and tries again a few times, then the line says so."""
    hub = plain_hub
    hub.stall["model.safetensors"] = 300_000
    r = run(fresh_clone, hub, HF_HUB_DOWNLOAD_TIMEOUT="1")
    assert_error(r, "could not download model.safetensors of Qwen/Qwen3-0.6B: the Hub stopped "
                 "answering (timed out)")


def test_a_repo_without_safetensors_weights(hub, fresh_clone, tmp_path):
    """A GGUF-only repo: one line, this script runs safetensors checkpoints."""
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "config.json").write_text("{}")
    (tmp_path / "gguf" / "model-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(1000))
    hub.add_repo("someone/Qwen3-0.6B-GGUF", tmp_path / "gguf", ["config.json", "model-Q4_K_M.gguf"])
    r = run(fresh_clone, hub, "--model", "someone/Qwen3-0.6B-GGUF")
    assert_error(r, "someone/Qwen3-0.6B-GGUF has no model.safetensors: this script runs "
                 "safetensors checkpoints (the repo holds config.json, model-Q4_K_M.gguf)")


def mounted(path, options):
    """A tmpfs mounted at path for the test (as root a mode of 555 refuses nobody; a read-only
    or full file system refuses root too), or skip where this machine cannot mount."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    return path


@pytest.mark.parametrize("kind", ["file", "read-only", "full"])
def test_a_folder_that_cannot_be_written(hub, fresh_clone, kind):
    """The default folder as a file, on a read-only file system, or on a full one: the line names
    the path and the cause, never the network."""
    folder = fresh_clone / "Qwen3-0.6B"
    if kind == "file":
        folder.write_text("not a folder")
        assert_error(run(fresh_clone, hub), f"{folder} is a file, not a folder")
        return
    mounted(folder, "ro,size=1m" if kind == "read-only" else "size=400k")
    try:
        r = run(fresh_clone, hub)
    finally:
        subprocess.run(["umount", str(folder)])
    if kind == "read-only":
        assert_error(r, f"could not download config.json of Qwen/Qwen3-0.6B: {folder}/.cache",
                     "cannot be written: read-only file system")
    else:
        assert_error(r, "could not download model.safetensors of Qwen/Qwen3-0.6B: the disk is full "
                     f"where it goes ({folder})")


SETTINGS = """
import os, signal, sys, warnings
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from huggingface_hub import logging
import llm_inference as li
def mine(signum, frame):
    pass
signal.signal(signal.SIGINT, mine)
logging.set_verbosity_error()
before, environ = list(warnings.filters), dict(os.environ)
try:
    li.download("Qwen/Qwen3-0.6B", Path(sys.argv[2]))
    print("fetched")
except SystemExit as e:
    print("failed:", e)
print(signal.getsignal(signal.SIGINT) is mine, logging.get_verbosity() == logging.ERROR,
      warnings.filters == before, dict(os.environ) == environ)
"""


@pytest.mark.parametrize("path, answer", [("plain", 200), ("xet", 200), ("plain", "the Hub's 500"),
                                          ("xet", "Xet storage's 500")])
def test_download_gives_the_callers_settings_back(checkpoint, fresh_clone, path, answer):
    """download() called from a notebook: whether it fetches or fails, the caller's SIGINT handler,
    huggingface_hub's verbosity, the warning filters and the environment (hf_xet's bounds) are as
    they were before it."""
    hub = stand_in(checkpoint, path == "xet")
    if answer == "the Hub's 500":
        hub.status["model.safetensors"] = 500
    elif answer == "Xet storage's 500":
        hub.storage_status["model.safetensors"] = (500, "xorb", 99)
    r = subprocess.run([sys.executable, "-c", SETTINGS, str(fresh_clone), str(fresh_clone / "m")],
                       env=environment(hub, fresh_clone / "hf"), capture_output=True, timeout=120)
    hub.close()
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode()
    assert ("fetched" if answer == 200 else "failed: error: could not download") in out, out
    assert out.strip().splitlines()[-1] == "True True True True", out


def test_a_reset_is_found_under_the_error_by_either_link():
    """was_reset(): a ConnectionResetError raised from (__cause__) or while handling (__context__)
    the error, at any depth, is a reset; none is not."""
    import llm_inference as li
    for link in ("__cause__", "__context__"):
        outer, middle = RuntimeError("outer"), OSError("middle")
        setattr(outer, link, middle)
        setattr(middle, link, ConnectionResetError(104, "Connection reset by peer"))
        assert li.was_reset(outer), link
        setattr(middle, link, TimeoutError())
        assert not li.was_reset(outer), link


# ─── Xet storage's own faults: hf_xet tries again by itself, then one line ───

XET_FAULTS = {  # a fault that persists -> (how to make it, what the line says of it)
    "reset": (lambda hub: hub.reset.update({"model.safetensors": (100_000, 99)}),
              "the connection to Xet storage broke or stalled before the file was whole"),
    "close_early": (lambda hub: hub.close_early.update({"model.safetensors": 100_000}),
                    "the connection to Xet storage broke or stalled before the file was whole"),
    "stall": (lambda hub: hub.stall.update({"model.safetensors": 100_000}),
              "the connection to Xet storage broke or stalled before the file was whole"),
    "500": (lambda hub: hub.storage_status.update({"model.safetensors": (500, "xorb", 99)}),
            "Xet storage at {cas} answered 500 Internal Server Error"),
    "403": (lambda hub: hub.storage_status.update({"model.safetensors": (403, "xorb", 99)}),
            "Xet storage at {cas} answered 403 Forbidden"),
    "401": (lambda hub: hub.storage_status.update({"model.safetensors": (401, "reconstruction", 99)}),
            "Xet storage at {cas} answered 401 Unauthorized"),
    "404": (lambda hub: hub.storage_status.update({"model.safetensors": (404, "reconstruction", 99)}),
            "Xet storage at {cas} answered 404 Not Found"),
    "malformed": (lambda hub: hub.malformed.add("model.safetensors"),
                  "Xet storage sent damaged data (chunk header version too high"),
    "unreachable": (lambda hub: setattr(hub, "storage_down", True),
                    "Xet storage at {nowhere} could not be reached"),
}


@pytest.mark.parametrize("fault", list(XET_FAULTS))
def test_a_xet_storage_fault_is_one_line_and_the_rerun_fetches_it(xet_hub, fresh_clone, fault):
    """Each fault of Xet storage that persists (hf_xet has tried again by itself): one line that
    names the file and the cause, exit 1, no traceback, nothing partial left; hf_xet's read timeout
    is huggingface_hub's (1 s here), so a stall ends too. The next run, the fault gone, fetches the
    file and runs."""
    hub = xet_hub
    make, words = XET_FAULTS[fault]
    make(hub)
    r = run(fresh_clone, hub, HF_HUB_DOWNLOAD_TIMEOUT="1")
    assert_error(r, "could not download model.safetensors of Qwen/Qwen3-0.6B: " +
                 words.format(cas=hub.cas_url, nowhere=hub.nowhere), ". To fetch it by hand, run")
    folder = fresh_clone / "Qwen3-0.6B"
    assert not (folder / "model.safetensors").exists()
    assert [f for f in folder.rglob("*") if f.name.endswith(".incomplete")] == []
    for faults in (hub.reset, hub.close_early, hub.stall, hub.storage_status, hub.malformed):
        faults.clear()
    hub.storage_down = False
    hub.requests.clear()
    again = run(fresh_clone, hub)
    assert again.returncode == 0 and "Generation: 3 tokens" in again.stdout, again.stderr
    assert xet_path_taken(hub)


def test_a_single_xet_fault_is_tried_again_unseen(xet_hub, fresh_clone):
    """One reset of Xet storage's connection, then one 500 of it: hf_xet tries the range again by
    itself, the run goes on, and the file is whole."""
    hub = xet_hub
    hub.reset["model.safetensors"] = (100_000, 1)
    hub.storage_status["model.safetensors"] = (500, "xorb", 1)
    r = run(fresh_clone, hub)
    assert r.returncode == 0 and "Generation: 3 tokens" in r.stdout, r.stderr
    assert (fresh_clone / "Qwen3-0.6B" / "model.safetensors").read_bytes() == \
        hub.repos["Qwen/Qwen3-0.6B"]["model.safetensors"]
    assert hub.resets_done["model.safetensors"] == 1 and xet_path_taken(hub)


def test_a_silent_download_says_so(capsys):
    """watched(): while nothing of a file comes, a line every quiet seconds says so (hf_xet tries
    again by itself, saying nothing); once something comes, the count starts again; after the
    block, no more lines and the watch has ended."""
    import threading
    import llm_inference as li
    with li.watched("model.safetensors", quiet=1) as bar_class:
        assert "watching model.safetensors" in [t.name for t in threading.enumerate()]
        deadline = time.monotonic() + 60
        while capsys.readouterr().err.count("nothing has come") < 1:  # (a busy machine: late)
            assert time.monotonic() < deadline
            time.sleep(0.1)
        bar = bar_class(total=10, disable=True)
        bar.update_transfer(5)  # bytes received: the silence is over
        bar.close()
    assert "watching model.safetensors" not in [t.name for t in threading.enumerate()]
    time.sleep(1.5)
    assert capsys.readouterr().err == ""
