"""Tensor parallel on MLX's own distributed engine (issue 43): under `mlx.launch -n N`, each
process (rank) holds 1/N of every block's weights and each block's two partial outputs are
added with mx.distributed.all_sum.

Every test runs the real launcher on this machine (N processes on 127.0.0.1, the ring backend)
against tiny checkpoints. What mlx.launch does, found by reading and running it (mlx 0.32):
- each rank's stdout and stderr are copied through unprefixed, as they come: rank 0's lines are
  told apart only by what they say (the script silences the others' stdout);
- it exits 0 whatever its ranks do, so the tests check the output, never its status;
- when a rank exits non-zero it sends the others SIGTERM, and says `[WARN] Node with rank R
  exited with code C` on stderr;
- its stdin is copied to every rank, whose own stdin it never closes; with its stdin at end of
  file (/dev/null) its loop spins a core, so launch() gives it a pipe kept open and empty;
- the ring backend listens from --starting-port (default 32323) upwards: each launch here takes
  free ports of its own, so that two runs at once do not meet;
- each rank leaves mktemp files (its pid and the host list) in $TMPDIR. launch() leaves
  $TMPDIR as it is: MLX's CPU backend compiles its kernels into $TMPDIR/mlx/, and a fresh
  folder each run costs tens of seconds of g++.
"""
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from test_cli_errors import run_cli

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "llm_inference.py"
PROMPT = "Once upon a time"


def find_launcher():
    """mlx.launch, the console script beside this Python (a virtualenv's bin), else on PATH."""
    here = Path(sys.executable).parent / "mlx.launch"
    return str(here) if here.exists() else shutil.which("mlx.launch")


LAUNCHER = find_launcher()
pytestmark = pytest.mark.skipif(LAUNCHER is None or not mx.distributed.is_available(),
                                reason="needs mlx.launch and mx.distributed (pip install mlx)")


def free_ports(n):
    """The first of n consecutive ports on 127.0.0.1 that nothing listens on now."""
    for _ in range(100):
        base = random.randrange(20000, 60000 - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def members(pgid):  # for a message: the processes still in the group (Linux: /proc)
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[2]) == pgid:
            found.append(f"{d.name}: {cmd}")
    return found


def launch(n, *args, timeout=120, script=None):
    """`mlx.launch -n n --python <this Python> -- <script> args` in a session of its own ->
    a CompletedProcess (text stdout and stderr) with .wall, its seconds. Past timeout, the
    whole session is killed and the test fails; after it, no process of the session may be
    left (the ranks are the launcher's children: it must have ended them)."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    cmd = [sys.executable, LAUNCHER, "-n", str(n), "--python", sys.executable,
           "--starting-port", str(free_ports(n)), "--", str(script or SCRIPT), *map(str, args)]
    stdin, keep_open = os.pipe()  # open and empty: at end of file mlx.launch spins
    tic = time.monotonic()
    try:
        p = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, env=env, cwd=ROOT)
    finally:
        os.close(stdin)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        left = members(p.pid)
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"mlx.launch ran past {timeout} s; killed: {left}\nstdout: {out[-2000:]!r}\n"
                    f"stderr: {err[-2000:]!r}")
    finally:
        os.close(keep_open)
    wall = time.monotonic() - tic
    for _ in range(50):  # (the launcher waits for its ranks: nothing should be left at all)
        if not alive(p.pid):
            break
        time.sleep(0.1)
    else:
        left = members(p.pid)
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"processes left behind by mlx.launch: {left}")
    r = subprocess.CompletedProcess(cmd, p.returncode, out.decode("utf-8"), err.decode("utf-8"))
    r.wall = wall
    return r


def shown(r):  # for assertion messages; the launcher's status only for information
    return f"\n[launcher exit {r.returncode}, {r.wall:.1f} s]\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"


# mlx.launch's own warning: a thread print()s it, whose pieces ("\x1b[33m[WARN]", " ", the
# message, " ", "\x1b[0m", "\n") go out as separate writes when stderr is unbuffered
# (PYTHONUNBUFFERED=1), while the main thread copies the ranks' bytes to the same stderr: a rank's
# line can land between any two (seen in CI: "\x1b[33m[WARN]error: ...").
LAUNCHER_WARNING = re.compile(r"\x1b\[33m\[WARN\] ?| ?Node with rank \d+ (?:exited with code "
                              r"-?\d+|was killed) ?| ?\x1b\[0m\n?")


def error_lines(stderr):
    """The ranks' lines that say error:, the launcher's warnings taken out wherever they fell."""
    ours = LAUNCHER_WARNING.sub("", stderr)
    return [line for line in ours.splitlines() if "error:" in line]


def completion(stdout):
    """The text between the two ========== lines: the prompt and what followed it."""
    parts = stdout.split("==========\n")
    assert len(parts) == 3, stdout
    return parts[1]


def divisible(folder, n):
    """Does n divide every count that is split (the config's, Qwen3.5's text_config)?"""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    keys = ["num_attention_heads", "num_key_value_heads", "intermediate_size",
            "linear_num_key_heads", "linear_num_value_heads"]
    return all(cfg[k] % n == 0 for k in keys if k in cfg)


@pytest.fixture(params=["qwen3", "qwen35"])
def model(request, checkpoint, qwen35):
    folder = checkpoint() if request.param == "qwen3" else qwen35()
    assert divisible(folder, 2)  # TINY: 4 / 2 heads, 160 features; TINY35: DeltaNet 2 / 4 heads
    return folder


# ─── The launcher itself ───

def test_launch_runs_each_rank_and_shows_its_output_unprefixed(tmp_path):
    script = tmp_path / "sum.py"
    script.write_text("import mlx.core as mx\ng = mx.distributed.init()\n"
                      "x = mx.distributed.all_sum(mx.array([g.rank() + 1.0]), group=g)\n"
                      "print(f'rank {g.rank()} of {g.size()}: {x.item()}', flush=True)\n")
    r = launch(2, script=script, timeout=60)
    assert sorted(r.stdout.splitlines()) == ["rank 0 of 2: 3.0", "rank 1 of 2: 3.0"], shown(r)


# ─── The same text as one process ───

def test_greedy_text_is_one_processs_printed_once(model):
    args = ["--model", model, "-p", PROMPT, "-m", "10"]
    one = run_cli(*args)
    assert one.returncode == 0, one.stderr
    r = launch(2, *args)
    assert error_lines(r.stderr) == [], shown(r)
    assert completion(r.stdout) == completion(one.stdout), shown(r)
    assert r.stdout.count(completion(one.stdout)) == 1
    summary = [line for line in r.stdout.splitlines() if line.startswith(("Qwen3 from", "Qwen3.5 from"))]
    assert len(summary) == 1, shown(r)
    assert len([line for line in r.stdout.splitlines() if line.startswith("All-sums: ")]) == 1
    peaks = [line for line in r.stdout.splitlines() if line.startswith("Peak memory: ")]
    assert len(peaks) == 1 and "(rank 0)" in peaks[0] and "(rank 1)" in peaks[0], shown(r)
    assert "All-sums: " not in one.stdout and "(rank 0)" not in one.stdout


def test_explain_runs_the_logit_lens_on_every_rank(model):
    """--explain's extra pass runs on every rank (each holds part of each block: one alone would
    wait on the others' sums for ever): one picture, printed once, of the same cells as one
    process draws."""
    from test_lens import parse_picture
    args = ["--model", model, "-p", PROMPT, "-m", "6", "--explain"]
    one = run_cli(*args)
    r = launch(2, *args)
    assert one.returncode == 0 and error_lines(r.stderr) == [], shown(r)
    assert r.stdout.count("the answer forming") == 1, shown(r)
    assert parse_picture(r.stdout)[1:4] == parse_picture(one.stdout)[1:4]


def test_four_processes_give_one_processs_text(checkpoint):
    folder = checkpoint(num_key_value_heads=4, num_attention_heads=8)
    assert divisible(folder, 4)
    args = ["--model", folder, "-p", PROMPT, "-m", "8", "-q"]
    one = run_cli(*args)
    assert one.returncode == 0 and one.stdout.strip(), one.stderr
    r = launch(4, *args)
    assert r.stdout == one.stdout, shown(r)
    assert error_lines(r.stderr) == [], shown(r)


LOGITS = """
import json, sys
import mlx.core as mx
import numpy as np
sys.path.insert(0, {root!r})
import llm_inference as li
folder, out = sys.argv[1], sys.argv[2]
g = mx.distributed.init()
li.load_checked(folder, group=g)
logits = li.prefill(li.tokenize("Once upon a time there was"), [None] * li.N_LAYERS)
np.save(f"{{out}}/logits-{{g.size()}}-{{g.rank()}}.npy", np.array(logits.astype(mx.float32)))
mixer = "linear_attn.A_log" if li.MODEL == "qwen3_5" else "self_attn.k_proj.weight"
shapes = {{k: li.W["model.layers.0." + k].shape for k in
          ["mlp.gate_proj.weight", "mlp.down_proj.weight", mixer, "input_layernorm.weight"]}}
json.dump({{"group": li.GROUP and li.GROUP.size(), "shapes": shapes}},
          open(f"{{out}}/info-{{g.size()}}-{{g.rank()}}.json", "w"))
"""


def test_logits_are_one_processs(model, tmp_path):
    """load_checked(folder, group=g) sets li.GROUP and keeps 1/2 of each split tensor (rows of
    gate, columns of down, half the KV heads or DeltaNet value heads; norms whole); prefill()'s
    logits are one process's, the same on both ranks."""
    driver = tmp_path / "logits.py"
    driver.write_text(LOGITS.format(root=str(ROOT)))
    one = subprocess.run([sys.executable, driver, model, tmp_path], capture_output=True, text=True,
                         timeout=120)
    assert one.returncode == 0, one.stderr
    r = launch(2, model, tmp_path, script=driver)
    assert (tmp_path / "logits-2-1.npy").exists(), shown(r)
    whole = json.loads((tmp_path / "info-1-0.json").read_text())
    assert whole["group"] is None
    for rank in (0, 1):
        info = json.loads((tmp_path / f"info-2-{rank}.json").read_text())
        assert info["group"] == 2
        for name, shape in whole["shapes"].items():
            axis = 1 if "down_proj" in name else None if "layernorm" in name else 0
            expected = [s // 2 if i == axis else s for i, s in enumerate(shape)]
            assert info["shapes"][name] == expected, (rank, name)
    expected = np.load(tmp_path / "logits-1-0.npy")
    got = np.load(tmp_path / "logits-2-0.npy")
    assert np.array_equal(np.load(tmp_path / "logits-2-1.npy"), got)  # an all_sum: the same sum
    # float32: the two halves' partial products are added in another order than one matmul
    # adds them (eps 1.2e-7; a few hundred terms a sum, 3-4 blocks): ~1e-6 of the logits'
    # scale. 1e-4 of it is ample for that, and far below what a wrong split does (order 1).
    scale = np.abs(expected).max()
    assert np.allclose(got, expected, rtol=1e-4, atol=1e-4 * scale), np.abs(got - expected).max()
    assert got.argmax() == expected.argmax()


# ─── Memory ───

PEAK = re.compile(r"([\d.]+) GB \(rank (\d+)\)")


def test_each_process_holds_half_the_blocks(checkpoint):
    """Blocks outweigh the embedding (hidden 256, MLP 2048, 4 layers: 26.7 MB of blocks, 1.3 MB
    embedding and LM head). Each of 2 processes peaks near half the blocks plus the whole
    tensors: under the whole tensors + half the blocks + a quarter of them (KV cache, activations,
    the load's one tensor at a time); a full copy of the blocks (one process's peak) is more."""
    folder = checkpoint(hidden_size=256, intermediate_size=2048, num_hidden_layers=4)
    weights = mx.load(str(folder / "model.safetensors"))
    split = sum(w.nbytes for name, w in weights.items()
                if re.search(r"(q|k|v|o|gate|up|down)_proj\.weight$", name))
    whole = sum(w.nbytes for w in weights.values()) - split
    assert split > 10 * whole
    args = ["--model", folder, "-p", PROMPT, "-m", "4"]
    one = run_cli(*args)
    one_peak = float(re.search(r"Peak memory: ([\d.]+) GB", one.stdout).group(1)) * 1e9
    assert one_peak >= whole + split - 1e6  # (printed to the MB)
    r = launch(2, *args)
    line = next((x for x in r.stdout.splitlines() if x.startswith("Peak memory: ")), None)
    assert line, shown(r)
    peaks = {int(rank): float(gb) * 1e9 for gb, rank in PEAK.findall(line)}
    assert sorted(peaks) == [0, 1], line
    upper = whole + split / 2 + split / 4
    assert upper < whole + split  # a process with every block's weights whole fails
    for rank, peak in peaks.items():
        assert whole + split / 2 - 1e6 <= peak <= upper, (rank, peak / 1e6, upper / 1e6, line)


# ─── Sampling ───

SAMPLED = """
import json, sys
sys.path.insert(0, {root!r})
import mlx.core as mx
import llm_inference as li
out = sys.argv[1]
rank = mx.distributed.init().rank()
real, ids = li.generate, []
def generate(*args, **kwargs):  # each rank's ids, written when it ends
    try:
        for token in real(*args, **kwargs):
            ids.append(token)
            yield token
    finally:
        json.dump(ids, open(f"{{out}}/ids-{{rank}}.json", "w"))
li.generate = generate
li.main(sys.argv[2:])
"""


def test_seeded_sampling_is_one_processs(checkpoint, tmp_path):
    args = ["--model", checkpoint(), "-p", PROMPT, "-m", "10", "--temp", "1", "--seed", "7", "-q"]
    one = run_cli(*args)
    assert one.returncode == 0 and one.stdout.strip(), one.stderr
    r = launch(2, *args)
    assert r.stdout == one.stdout, shown(r)
    other = run_cli(*args[:-2], "8", "-q")  # (another seed: another text, so the seed counted)
    assert other.stdout != one.stdout


def test_unseeded_sampling_shares_rank_0s_seed(checkpoint, tmp_path):
    """No --seed: each rank would seed itself; they take rank 0's, so they draw the same ids
    (else their caches part, and one stopping at an EOS before the other hangs it)."""
    driver = tmp_path / "sampled.py"
    driver.write_text(SAMPLED.format(root=str(ROOT)))
    r = launch(2, tmp_path, "--model", checkpoint(), "-p", PROMPT, "-m", "12", "--temp", "1",
               script=driver, timeout=90)
    assert error_lines(r.stderr) == [], shown(r)
    ids = [json.loads((tmp_path / f"ids-{rank}.json").read_text()) for rank in (0, 1)]
    assert ids[0] and ids[0] == ids[1], ids
    assert r.stdout.count(PROMPT) == 1 and r.stdout.count("==========\n") == 2, shown(r)


# ─── Errors ───

def test_n_not_dividing_the_kv_heads_is_said_once(checkpoint):
    folder = checkpoint()  # TINY: 2 KV heads, 4 query heads, 160 MLP features
    r = launch(4, "--model", folder, "-p", PROMPT, "-m", "3", timeout=60)
    errors = error_lines(r.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: "), shown(r)
    assert "KV heads" in errors[0] and re.search(r"\b2 KV heads", errors[0]), errors[0]
    assert re.search(r"\b4\b", errors[0]), errors[0]
    assert "Traceback" not in r.stderr and "==========" not in r.stdout, shown(r)


RANK_1_MISSING = """
import runpy, sys
import mlx.core as mx
script, folder, missing = sys.argv[1:]
rank = mx.distributed.init().rank()
sys.argv = [script, "--model", missing if rank == 1 else folder, "-p", "Once upon a time", "-m", "3"]
runpy.run_path(script, run_name="__main__")
"""


def test_an_error_of_one_rank_names_it(checkpoint, tmp_path):
    driver = tmp_path / "rank1.py"
    driver.write_text(RANK_1_MISSING)
    missing = tmp_path / "nowhere"
    r = launch(2, SCRIPT, checkpoint(), missing, script=driver, timeout=60)
    errors = error_lines(r.stderr)
    assert len(errors) == 1 and errors[0].startswith("rank 1: error: "), shown(r)
    assert str(missing) in errors[0] and "does not exist" in errors[0], errors[0]
    assert "Traceback" not in r.stderr and "==========" not in r.stdout, shown(r)
    assert r.wall < 30, shown(r)


DIES = """
import os, sys
sys.path.insert(0, {root!r})
import mlx.core as mx
import llm_inference as li
rank, prompt = mx.distributed.init().rank(), []
real_prefill, real_forward = li.prefill, li.forward
def prefill(ids, *args, **kwargs):
    prompt.append(len(ids))
    return real_prefill(ids, *args, **kwargs)
def forward(ids, cache, start, *args, **kwargs):  # positions P, P+1: the 1st and 2nd ids fed back
    if rank == 1 and prompt and start >= prompt[0] + 2:
        print("rank 1 dies after 2 tokens", file=sys.stderr, flush=True)
        os._exit(3)
    return real_forward(ids, cache, start, *args, **kwargs)
li.prefill, li.forward = prefill, forward
li.main(sys.argv[1:])
"""


def test_a_rank_that_dies_ends_the_others(checkpoint, tmp_path):
    args = ["--model", checkpoint(), "-p", PROMPT, "-m", "30"]
    one = run_cli(*args)
    assert int(re.search(r"Generation: (\d+) tokens", one.stdout).group(1)) >= 5  # no early EOS
    driver = tmp_path / "dies.py"
    driver.write_text(DIES.format(root=str(ROOT)))
    r = launch(2, *args, script=driver, timeout=120)
    assert "rank 1 dies after 2 tokens" in r.stderr, shown(r)
    assert "Peak memory" not in r.stdout, shown(r)  # rank 0 ended, not finished
    assert r.wall < 60, shown(r)  # (seconds, in fact: mlx.launch ends the rest at once)


def test_prompt_from_stdin_is_refused(checkpoint):
    r = launch(2, "--model", checkpoint(), "-p", "-", "-m", "3", timeout=60)
    errors = error_lines(r.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: ") and "--prompt -" in errors[0], shown(r)
    assert "==========" not in r.stdout


def test_a_conversation_is_refused(checkpoint):
    r = launch(2, "--model", checkpoint(), "--chat", "-m", "3", timeout=60)
    errors = error_lines(r.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: ") and "--chat" in errors[0], shown(r)
    assert "==========" not in r.stdout


# ─── The launcher's own lines, as a caller meets them ───

class Rank:  # a stand-in for mx.distributed's group, as rank r of n sees it
    def __init__(self, r, n=2):
        self.r, self.n = r, n

    def rank(self):
        return self.r

    def size(self):
        return self.n


@pytest.mark.parametrize("way_out", ["return", "exception"])
def test_ranks_after_0_get_their_stdout_back(way_out):
    """rank_zero_prints(): rank 0 prints; another rank's output goes nowhere inside, and its own
    sys.stdout is back after, whichever way the block ends."""
    import sys as system
    import llm_inference as li
    mine = system.stdout
    for r in (0, 1):
        try:
            with li.rank_zero_prints(Rank(r)):
                assert (system.stdout is mine) == (r == 0)
                if way_out == "exception":
                    raise ValueError("a bug")
        except ValueError:
            pass
        assert system.stdout is mine


def test_the_all_sums_timed_are_chained_as_a_pass_runs_them(monkeypatch):
    """all_sum_seconds(): each sum takes the one before's result (a block waits for the one
    before), all in one graph evaluated once per try; the best of the tries."""
    import llm_inference as li
    given, made = [], []

    def all_sum(x, group=None):
        given.append(x)
        made.append(x + 1)
        return made[-1]

    monkeypatch.setattr(li.mx.distributed, "all_sum", all_sum)
    x = mx.zeros((1, 4))
    li.all_sum_seconds(5, x, tries=3)
    assert len(given) == 15
    for t in range(3):
        assert given[5 * t] is x and all(given[5 * t + i] is made[5 * t + i - 1] for i in range(1, 5))


@pytest.mark.parametrize("width", ["query heads", "MLP features", "DeltaNet values"])
def test_quantised_groups_that_straddle_a_split_are_refused(width):
    """2 processes that divide every count, but whose share of one split input (o_proj's, down's,
    out_proj's: 192 numbers a row, 3 whole groups of 64) is 96, a group cut in two: refused
    before any weight is read. With 128 a rank (2 groups each), it runs."""
    import llm_inference as li
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "intermediate_size": 256, "quantization": {"group_size": 64, "bits": 4},
           "qwen35": {"linear_num_key_heads": 2, "linear_num_value_heads": 2,
                      "linear_value_head_dim": 128}, "moe": {}}
    li.check_split(cfg, 2)  # 256 numbers a row in each: 128 a rank, whole groups
    if width == "query heads":
        cfg["num_attention_heads"], cfg["head_dim"] = 6, 32  # 192
    elif width == "MLP features":
        cfg["intermediate_size"] = 192
    else:
        cfg["qwen35"]["linear_value_head_dim"] = 96  # 2 x 96 = 192
    with pytest.raises(li.UserError, match="the quantisation's groups of 64"):
        li.check_split(cfg, 2)


def test_drafting_under_two_processes_counts_its_passes(qwen35):
    """--draft mtp --explain under mlx.launch -n 2: a pass of the model serves 1 + its accepted
    drafts, and has 2 all-sums a block, its MTP head's layer one more block: the All-sums line
    counts them a pass and gives their share of a pass's time, which the rate and the passes
    printed give back (it was a token's, and over 100% when drafts were accepted)."""
    r = launch(2, "--model", qwen35(mtp="agree"), "-p", PROMPT, "-m", "12", "--draft", "mtp",
               "--explain", "--lens-tokens", "1")
    assert error_lines(r.stderr) == [], shown(r)
    import llm_inference as li
    li.load(qwen35(mtp="agree"))
    n, rate = re.search(r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec", r.stdout).groups()
    passes = re.search(r"(\d+) tokens in (\d+) passes of the model", r.stdout)
    sums = re.search(r"All-sums: (\d+) a pass \(2 a block\) over 2 processes, [\d.]+ kB each; timed "
                     r"alone, ([\d.]+) ms a pass: ([\d.]+)% of its time", r.stdout)
    assert passes and sums and passes[1] == n, shown(r)
    assert int(sums[1]) == 2 * (li.N_LAYERS + 1)
    per_pass = int(n) / int(passes[2])
    share = 100 * float(sums[2]) / 1e3 * float(rate) / per_pass
    assert float(sums[3]) == pytest.approx(share, rel=0.02, abs=0.15), shown(r)


# ─── Mixtures of experts: each expert's features cut, the router whole, one sum a block ───

@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen35_moe", "4-bit"])
def test_a_mixture_under_two_processes_is_one_processs(qwen3_moe, qwen35_moe, tmp_path, kind):
    """Qwen3-MoE, Qwen3.5-MoE (a shared expert, an MTP head), and a 4-bit conversion with its
    8-bit routers (each expert 64 features wide: 32 a rank, whole groups of 32): the same text
    as one process; the mixture's and the shared expert's parts added in one sum, so 2 a block."""
    if kind == "4-bit":
        from mlx_lm.convert import convert
        folder = tmp_path / "q4"
        convert(str(qwen3_moe(moe_intermediate_size=64)), str(folder), quantize=True,
                q_group_size=32, q_bits=4)
    else:
        folder = qwen3_moe() if kind == "qwen3_moe" else qwen35_moe()
    args = ["--model", folder, "-p", PROMPT, "-m", "10"]
    one = run_cli(*map(str, args))
    r = launch(2, *args)
    assert one.returncode == 0 and error_lines(r.stderr) == [], shown(r)
    assert completion(r.stdout) == completion(one.stdout), shown(r)
    import llm_inference as li
    li.load_checked(folder)
    assert f"All-sums: {2 * li.N_LAYERS} a pass (2 a block)" in r.stdout, shown(r)


def test_all_sum_seconds_is_the_best_of_its_tries(monkeypatch):
    """all_sum_seconds() says the fastest try, not their mean: a busy machine delays some tries
    by far more than the sums take. No race with the clock: the timer is a counter that each
    all-sum moves on by a known step, so the tries take 0.75, 0.25, 1 and 0.5 "seconds" (2 sums
    each; dyadic steps, so the sums are exact) and the answer is 0.25 (their mean: 0.625). The
    sums themselves run, over a one-process group."""
    import types
    import itertools
    import llm_inference as li
    monkeypatch.setattr(li, "GROUP", mx.distributed.init())  # a group of one: this process
    now, steps = [0.0], itertools.cycle([0.375, 0.375, 0.125, 0.125, 0.5, 0.5, 0.25, 0.25])
    real = mx.distributed.all_sum

    def all_sum(x, group=None):
        assert group is li.GROUP
        now[0] += next(steps)
        return real(x, group=group)

    monkeypatch.setattr(li.mx.distributed, "all_sum", all_sum)
    monkeypatch.setattr(li, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    assert li.all_sum_seconds(2, mx.ones((1, 4)), tries=4) == 0.25
    assert now[0] == 2.5  # 4 tries of 2 sums each, timed once each


# ─── The context limit's note, said once ───

NOTE = "[note: generation stops at the context limit, 32 tokens]"


@pytest.mark.parametrize("prompts", [["The capital of France is"],
                                     ["The capital of France is", "Once upon a time"]],
                         ids=["one answer", "a batch"])
def test_the_context_limit_note_is_said_once(checkpoint, prompts):
    """A prompt and --max-tokens past the context (32 positions here): one process says so once on
    stderr; under mlx.launch -n 2 every rank reaches that check, and the note comes once too (rank
    0's), as every other line the ranks share does. The text is one process's."""
    args = ["--model", checkpoint(max_position_embeddings=32), "-m", "100", "-q"]
    for prompt in prompts:
        args += ["-p", prompt]
    one = run_cli(*map(str, args))
    assert one.returncode == 0 and one.stderr.count(NOTE) == 1, one.stderr
    r = launch(2, *args)
    assert error_lines(r.stderr) == [], shown(r)
    assert r.stdout == one.stdout, shown(r)
    assert r.stderr.count(NOTE) == 1, shown(r)


def test_a_kv_cache_in_bits_under_two_processes_is_one_processs(checkpoint):
    """--kv-bits 4 under mlx.launch: each rank keeps its own heads' keys and values in bits; the
    text is one process's with the same flags."""
    folder = checkpoint()
    assert divisible(folder, 2)
    args = ["--model", str(folder), "-p", PROMPT, "-m", "10", "--kv-bits", "4",
            "--kv-group-size", "32", "--quantized-kv-start", "0"]
    one = run_cli(*args)
    r = launch(2, *args)
    assert one.returncode == 0 and error_lines(r.stderr) == [], shown(r)
    assert completion(r.stdout) == completion(one.stdout), shown(r)
    assert "in 4 bits, groups of 32" in r.stdout, shown(r)
