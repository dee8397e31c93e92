"""Bad input gets one clear line on stderr, a non-zero exit and no traceback (issue 5).

Every test runs the real command line in a subprocess against tiny checkpoints written by the
fixtures, or deliberately broken copies of them.
"""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import llm_inference as li

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, stdin=None, env=None, cwd=None, script=ROOT / "llm_inference.py"):
    env = dict(os.environ, PYTHONIOENCODING="utf-8", **(env or {}))
    r = subprocess.run([sys.executable, str(script), *args], input=stdin, cwd=cwd,
                       capture_output=True, env=env, timeout=120)
    r.stdout, r.stderr = r.stdout.decode("utf-8"), r.stderr.decode("utf-8")  # no newline translation
    return r


def assert_error(r, *needles):
    """A failed run: non-zero exit, one line on stderr, no traceback, each needle in that line."""
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def save_weights(path, weights, **kw):
    """mx.save_safetensors(path, weights), never over the file they were loaded from: mx.load reads
    a tensor only when it is used, and saving over its file truncates it first (MLX 0.29.3 then
    saves wrong values, at times NaN and inf; 0.32.2 fails to read; 0.32.4 reads them all first).
    Written beside it, then renamed over it: the open file keeps its data until then."""
    path = Path(path)
    part = path.with_name(f".{path.stem}.partial.safetensors")
    mx.save_safetensors(str(part), weights, **kw)
    os.replace(part, path)


@pytest.fixture
def broken(checkpoint, tmp_path):
    """A fresh copy of the tiny checkpoint to break."""
    return Path(shutil.copytree(checkpoint(), tmp_path / "model"))


def test_missing_folder(tmp_path):
    r = run_cli("--model", str(tmp_path / "nowhere"))
    assert_error(r, f"{tmp_path / 'nowhere'} does not exist")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file(broken, name):
    (broken / name).unlink()
    assert_error(run_cli("--model", str(broken)), f"{broken} lacks {name}")


def test_missing_shard(checkpoint, tmp_path):
    """A shard that model.safetensors.index.json names and the folder lacks is named."""
    folder = Path(shutil.copytree(checkpoint(shards=3), tmp_path / "sharded"))
    (folder / "model-00002-of-00003.safetensors").unlink()
    assert_error(run_cli("--model", str(folder)), f"{folder} lacks model-00002-of-00003.safetensors")


def test_tokenizer_not_parsable(broken):
    (broken / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    assert_error(run_cli("--model", str(broken)), str(broken / "tokenizer.json"), "tokenizer")


def test_config_not_json(broken):
    (broken / "config.json").write_text("{ this is not json")
    assert_error(run_cli("--model", str(broken)), "config.json is not valid JSON")


@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe", None])
def test_other_architecture(broken, model_type):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = model_type
    (broken / "config.json").write_text(json.dumps(cfg))
    assert_error(run_cli("--model", str(broken)), 'model_type must be "qwen3"', json.dumps(model_type))


def test_config_key_missing(broken):
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (broken / "config.json").write_text(json.dumps(cfg))
    assert_error(run_cli("--model", str(broken)), "config.json has no 'num_hidden_layers'")


@pytest.mark.parametrize("damage", ["truncated", "not_safetensors", "empty"])
def test_broken_weights_file(broken, damage):
    path = broken / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "not_safetensors": b"<html>404</html>" * 10,
                      "empty": b""}[damage])
    assert_error(run_cli("--model", str(broken)), str(path), "not a complete safetensors file")


def test_tensor_missing_or_wrong_shape(broken):
    path = broken / "model.safetensors"
    w = mx.load(str(path))
    w["model.layers.2.self_attn.k_proj.weight"] = mx.zeros((3, 64))
    save_weights(path, w, metadata={"format": "pt"})
    assert_error(run_cli("--model", str(broken)), "model.layers.2.self_attn.k_proj.weight has shape (3, 64)",
                 "expected shape (64, 64)")
    del w["model.layers.2.self_attn.k_proj.weight"]
    save_weights(path, w, metadata={"format": "pt"})
    assert_error(run_cli("--model", str(broken)), "model.layers.2.self_attn.k_proj.weight is missing",
                 "expected shape (64, 64)")


@pytest.mark.parametrize("args, needle", [
    (["--prompt", ""], "the prompt is empty"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--max-tokens", "-5"], "--max-tokens must be at least 1"),
    (["--max-tokens", "many"], "invalid int value: 'many'"),
    (["--temperature", "-0.5"], "--temperature must be 0 or more"),
    (["--temp", "nan"], "--temperature must be 0 or more"),
    (["--top-p", "0"], "--top-p must be more than 0 and at most 1"),
    (["--top-p", "1.5"], "--top-p must be more than 0 and at most 1"),
    (["--top-k", "-1"], "--top-k must be 0 or more"),
    (["--min-p", "1.5"], "--min-p must be from 0 to 1"),
    (["--top-x", "5"], "unrecognized arguments: --top-x 5"),
    (["--show-probs", "-1"], "--show-probs must be 0 or more"),
    (["--seed", "-1"], "--seed must be from 0 to 2**64 - 1"),
    (["--seed", str(2**64)], "--seed must be from 0 to 2**64 - 1"),
    (["--think"], "--think needs --chat"),
    (["--chat", "--think", "--no-think"], "argument --no-think: not allowed with argument --think"),
])
def test_bad_flags(checkpoint, args, needle):
    assert_error(run_cli("--model", str(checkpoint()), *args), needle)


def test_empty_prompt_from_stdin(checkpoint):
    assert_error(run_cli("--model", str(checkpoint()), "--prompt", "-", stdin=b""), "the prompt is empty")


@pytest.mark.parametrize("chat", [False, True])
def test_stdin_not_utf8(checkpoint, chat):
    args = ["--chat"] if chat else ["--prompt", "-"]
    r = run_cli("--model", str(checkpoint()), *args, stdin=b"caf\xe9 latin-1\n")
    assert_error(r, "standard input is not UTF-8 text", "at byte 3")


def test_output_into_a_reader_that_stops_early(checkpoint):
    """`python llm_inference.py | head -c 20`: the reader goes away; the script stops quietly."""
    cmd = f"'{sys.executable}' '{ROOT / 'llm_inference.py'}' --model '{checkpoint()}' -m 500 | head -c 20"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, timeout=120)
    assert len(r.stdout) == 20 and r.stderr == b"", r.stderr
    assert r.returncode in (0, 128 + signal.SIGPIPE)  # killed by SIGPIPE, as `cat` would be


def test_prompt_longer_than_context(checkpoint, tokenizer):
    folder = checkpoint(max_position_embeddings=32)
    prompt = "The capital of France is Paris. " * 10
    assert len(tokenizer.encode(prompt).ids) > 32
    r = run_cli("--model", str(folder), "--prompt", prompt)
    assert_error(r, "the context holds 32")
    assert "Prompt:" not in r.stdout and "Paris" not in r.stdout  # refused before anything


def test_generation_stops_at_context_limit(checkpoint, tokenizer):
    folder = checkpoint(max_position_embeddings=32)
    prompt = "The capital of France is"
    n_prompt = len(tokenizer.encode(prompt).ids)
    r = run_cli("--model", str(folder), "--prompt", prompt, "--max-tokens", "100")
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "context limit, 32 tokens" in r.stderr
    assert f"Generation: {32 - n_prompt} tokens" in r.stdout
    li.load(folder)
    assert len(list(li.generate(tokenizer.encode(prompt).ids, max_tokens=100))) == 32 - n_prompt


def test_extreme_sampling_settings_never_nan():
    rng = np.random.default_rng(0)
    for _ in range(10):
        logits = mx.array(rng.normal(0, 5, 500).astype(np.float32))
        best = int(np.argmax(np.array(logits)))
        assert li.sample(logits, temperature=1e-30).item() == best           # behaves like greedy
        assert li.sample(logits, temperature=1.0, top_p=1e-12).item() == best  # nucleus of one
        assert 0 <= li.sample(logits, temperature=1e30).item() < 500         # no NaN: a valid id
    bf16 = mx.array(rng.normal(0, 30, 500).astype(np.float32)).astype(mx.bfloat16)
    assert li.sample(bf16, temperature=1e-30).item() == li.sample(bf16).item()


def test_extreme_sampling_flags_match_greedy(checkpoint):
    args = ("--model", str(checkpoint()), "--prompt", "Once upon a time", "-m", "12")
    greedy = run_cli(*args).stdout.split("==========")[1]
    for extra in (["--temp", "1e-30"], ["--temp", "1", "--top-p", "1e-12"]):
        r = run_cli(*args, *extra)
        assert r.returncode == 0 and r.stdout.split("==========")[1] == greedy


def test_ids_beyond_the_tokenizer_never_crash(checkpoint, tokenizer):
    li.load(checkpoint())
    assert li.W["lm_head.weight"].shape[0] > tokenizer.get_vocab_size()  # as 151936 > 151669
    text = "Paris ❤️"
    ids = [tokenizer.get_vocab_size(), 639] + tokenizer.encode(text).ids + [600]
    assert "".join(piece for _, piece in li.stream_text(ids)) == text


@pytest.mark.parametrize("prompt", ["Emoji 😀👍🏽❤️ and 🇫🇷", "日本語と中文", "e\u0301 combining a\u0308",
                                    "tab\there\r\ncarriage\rreturn", "nul\x00byte"])
def test_unusual_prompts_run_normally(checkpoint, prompt):
    r = run_cli("--model", str(checkpoint()), "--prompt", "-", "-m", "5", stdin=prompt.encode())
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "==========\n" + prompt in r.stdout  # streamed back exactly, no broken characters
    assert "\ufffd" not in r.stdout.split("==========")[1][: len(prompt) + 1]


# Run as `python -c HOLD_IN_PREFILL llm_inference.py FLAGS`: the program as its own __main__, but
# that the first mx.eval() made inside a prefill (its first step in the cache) says so on the screen
# and then waits, until Ctrl-C raises KeyboardInterrupt there, as it would at the end of that step's
# eval. A Ctrl-C is then sure to land inside the prefill, however fast or loaded the machine: no
# sleep is raced against the prefill's end.
HOLD_IN_PREFILL = """
import runpy, sys, time
import mlx.core as mx
evaluate, held = mx.eval, []
def eval_holding(*args):
    evaluate(*args)
    frame, callers = sys._getframe(1), []
    while frame:
        callers.append(frame.f_code.co_name)
        frame = frame.f_back
    if not held and any("prefill" in name or name == "hidden_pass" for name in callers):
        held.append(callers)
        try:  # (the marker inside: a Ctrl-C right after it is caught here too)
            print("[test: a prefill step is in the cache; waiting for Ctrl-C]", flush=True)
            for _ in range(6000):  # Python acts on a signal between calls, and one that came
                time.sleep(0.1)    # before a sleep began does not end it: short sleeps
        except KeyboardInterrupt:
            print("[test: Ctrl-C in the prefill]", flush=True)
            raise
mx.eval = eval_holding
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def interrupt(args, wait_for, delay, then=0, hook=None):
    """Start the CLI (hook: Python run in its place, as HOLD_IN_PREFILL), wait until stdout shows
    wait_for and `then` more bytes, wait delay seconds, press Ctrl-C."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1")
    start = [sys.executable] + (["-c", hook] if hook else [])
    p = subprocess.Popen(start + [str(ROOT / "llm_inference.py"), *args], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen, wanted = b"", wait_for.encode()
    while wanted not in seen or len(seen) < seen.index(wanted) + len(wanted) + then:
        chunk = os.read(p.stdout.fileno(), 4096)
        assert chunk, (seen, p.stderr.read())
        seen += chunk
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)  # (only bounds a hang)
    return p.returncode, (seen + out).decode(), err.decode()


@pytest.fixture(scope="module")
def slow_checkpoint(tmp_path_factory, tokenizer):
    """Wide enough that a long prompt's prefill takes seconds on a CPU."""
    from conftest import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("slow"), tokenizer, hidden_size=512,
                            intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=64, max_position_embeddings=8192)


# Ctrl-C takes the default action: the process ends at once, killed by SIGINT (a shell shows
# exit status 130), with nothing on stderr; what was printed stays.
def test_ctrl_c_during_prefill(checkpoint):
    prompt = "The capital of France is Paris. " * 4  # held in its prefill (HOLD_IN_PREFILL)
    code, out, err = interrupt(["--model", str(checkpoint()), "--prompt", prompt],
                               "[test: a prefill step is in the cache", 0.3, hook=HOLD_IN_PREFILL)
    assert code == -signal.SIGINT and err == "", err
    # Killed inside the prefill, at once: the hold would have kept it there for ten minutes.
    assert "==========" not in out and "[test: Ctrl-C" not in out


def test_ctrl_c_during_generation(slow_checkpoint):
    folder = str(slow_checkpoint)
    code, out, err = interrupt(["--model", folder, "--prompt", "Once upon a time", "-m", "100000"],
                               "==========\nOnce upon a time", 0.5, then=1)  # generating
    assert code == -signal.SIGINT and "Traceback" not in err, err
    shown = out.split("==========\n", 1)[1]
    assert "Generation:" not in shown and len(shown) > len("Once upon a time")
    li.load(folder)  # what was streamed stays: the text so far begins the greedy continuation
    ids = li.TOK.encode("Once upon a time").ids
    pieces = li.stream_text(li.generate(ids, max_tokens=60))
    assert ("Once upon a time" + "".join(piece for _, piece in pieces)).startswith(shown)


def test_ctrl_c_at_the_chat_prompt(checkpoint):
    env = dict(os.environ, PYTHONIOENCODING="utf-8", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, str(ROOT / "llm_inference.py"), "--model", str(checkpoint()),
                          "--chat", "-m", "3"], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdin.write(b"Hi\n")
    p.stdin.flush()
    seen = b""
    while b"Peak memory" not in seen:  # the first turn is done; now it waits for the next line
        chunk = os.read(p.stdout.fileno(), 4096)
        assert chunk, seen
        seen += chunk
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    p.wait(timeout=30)  # stdin stays open, as at a terminal: only Ctrl-C can end it
    out, err = p.stdout.read(), p.stderr.read()
    p.stdin.close()
    assert p.returncode == -signal.SIGINT and err == b"", err
    assert (seen + out).count(b"Peak memory") == 1  # no stale stats from the finished turn


# Issue 13: every file checked for what it must hold, before any work.
def edit_json(path, change):
    data = json.loads(path.read_text())
    path.write_text(json.dumps(change(data)))


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("content", [[1, 2], None, "qwen3"])
def test_config_not_an_object(broken, name, content):
    (broken / name).write_text(json.dumps(content))
    assert_error(run_cli("--model", str(broken)), f"{broken / name} must hold a JSON object {{...}}, "
                 f"not {json.dumps(content)}")


@pytest.mark.parametrize("entry, value, what", [
    ("num_hidden_layers", "3", "a whole number of 1 or more"),
    ("hidden_size", 64.0, "a whole number of 1 or more"),
    ("num_attention_heads", 0, "a whole number of 1 or more"),
    ("vocab_size", -640, "a whole number of 1 or more"),
    ("max_position_embeddings", None, "a whole number of 1 or more"),
    ("intermediate_size", True, "a whole number of 1 or more"),
    ("head_dim", 33, "an even whole number (RoPE turns pairs)"),
    ("rms_norm_eps", "1e-6", "a number more than 0"),
    ("rms_norm_eps", None, "a number more than 0"),
    ("rope_theta", 0, "a number more than 0"),
    ("tie_word_embeddings", "yes", "true or false"),
    ("eos_token_id", [2, "<|im_end|>"], "a token id, a list of them or null"),
    ("eos_token_id", [2, None], "a token id, a list of them or null"),
])
def test_config_entry_of_the_wrong_kind(broken, entry, value, what):
    edit_json(broken / "config.json", lambda cfg: cfg | {entry: value})
    r = run_cli("--model", str(broken), "-m", "3")
    assert_error(r, f"{broken / 'config.json'}: {entry} must be {what}, not {json.dumps(value)}")
    assert "==========" not in r.stdout  # checked at load, before any work


def test_generation_config_eos_of_the_wrong_kind(broken):
    edit_json(broken / "generation_config.json", lambda gen: gen | {"eos_token_id": "<|im_end|>"})
    assert_error(run_cli("--model", str(broken)), f"{broken / 'generation_config.json'}: eos_token_id "
                 'must be a token id, a list of them or null, not "<|im_end|>"')


def test_entry_missing_after_one_of_the_value_1(broken):
    """Each entry is checked for its presence before any rule reads it (head_dim, after heads of 1)."""
    edit_json(broken / "config.json", lambda cfg: {k: v for k, v in cfg.items() if k != "head_dim"}
              | {"num_key_value_heads": 1})
    assert_error(run_cli("--model", str(broken)), "config.json has no 'head_dim' entry")


def test_heads_not_in_groups(broken):
    edit_json(broken / "config.json", lambda cfg: cfg | {"num_key_value_heads": 3})
    assert_error(run_cli("--model", str(broken)), "num_attention_heads must be a multiple of "
                 "num_key_value_heads")


def test_rope_theta_missing_or_nested(checkpoint, broken):
    edit_json(broken / "config.json", lambda cfg: {k: v for k, v in cfg.items() if k != "rope_theta"})
    assert_error(run_cli("--model", str(broken)), "config.json has no 'rope_theta' entry")
    r = run_cli("--model", str(checkpoint(rope="nested")), "-m", "2")  # transformers 5's layout
    assert r.returncode == 0, r.stderr


def test_tokenizer_of_another_model(checkpoint, tokenizer):
    """Its ids index past the embedding table, which MLX does not bounds-check: the text would
    be computed from memory that is not the model's."""
    folder = checkpoint(vocab_size=256)  # weights for 256 ids; this tokenizer has more
    top = tokenizer.get_vocab_size(with_added_tokens=True) - 1
    assert top >= 256
    r = run_cli("--model", str(folder), "-m", "3")
    assert_error(r, f"{folder / 'tokenizer.json'} has ids up to {top}, past the 256 rows of the "
                 f"embedding (vocab_size in {folder / 'config.json'})")
    assert r.stdout == ""


def test_model_is_a_file(checkpoint):
    path = checkpoint() / "config.json"
    assert_error(run_cli("--model", str(path)), f"{path} is a file, not a folder")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_folder_where_a_file_belongs(broken, name):
    (broken / name).unlink()
    (broken / name).mkdir()
    assert_error(run_cli("--model", str(broken)), f"{broken / name} cannot be read: is a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_file_that_cannot_be_read(broken):
    (broken / "config.json").chmod(0)
    assert_error(run_cli("--model", str(broken)), f"{broken / 'config.json'} cannot be read: "
                 "permission denied")


def test_file_that_cannot_be_read_in_process(broken, monkeypatch):
    """The same path as a permission error takes for a user who is not root (root reads any
    file, so the refusal is made by a stand-in for open())."""
    def refuse(path, *args):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(li, "open", refuse, raising=False)
    with pytest.raises(li.UserError, match=f"{broken / 'config.json'} cannot be read: permission denied$"):
        li.load_checked(broken)


@pytest.mark.parametrize("flag", [["--system", "Be brief."], ["--no-think"]])
def test_chat_flags_without_chat(checkpoint, flag):
    assert_error(run_cli("--model", str(checkpoint()), *flag), f"{flag[0]} needs --chat")
    r = run_cli("--model", str(checkpoint()), "--chat", "--prompt", "Hi", "-m", "2", *flag)
    assert r.returncode == 0, r.stderr


def test_a_bug_keeps_its_traceback(checkpoint):
    """Only the project's own UserError becomes one line. A ValueError raised inside the model (a
    bug; here mx.softmax is replaced by one that raises) reaches the user with its traceback."""
    code = ("import runpy, sys, mlx.core as mx\n"
            "def broken(*args, **kwargs):\n"
            "    raise ValueError('a bug inside the model')\n"
            "mx.softmax = broken\n"
            f"sys.argv = ['llm_inference.py', '--model', {str(checkpoint())!r}, '-m', '2']\n"
            f"runpy.run_path({str(ROOT / 'llm_inference.py')!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "Traceback (most recent call last)" in r.stderr
    assert r.stderr.rstrip().endswith("ValueError: a bug inside the model")
    assert "in attend" in r.stderr  # where it happened
    assert not any(line.startswith("error: ") for line in r.stderr.splitlines())


# Issue 20: nothing computed from the wrong weights.
@pytest.mark.parametrize("leftover", ["model.safetensors", "older shards"])
def test_folder_holding_two_checkpoints(checkpoint, tokenizer, tmp_path, leftover):
    """A sharded checkpoint with its index, and beside it what an earlier download left: a
    single model.safetensors, or an older set of shards, of other weights. Only what the index
    names is read, each tensor from the file it names: the logits equal those of the sharded
    set alone, which equal mlx-lm's on it. (Reading every *.safetensors, later files overwriting
    earlier ones, computed the leftover model.)"""
    from test_model import TEXT, mlx_lm_logits, rel_err
    new = checkpoint(shards=3)
    old = checkpoint(seed=7, shards=1 if leftover == "model.safetensors" else 2)
    mixed = Path(shutil.copytree(new, tmp_path / "mixed"))
    for file in old.glob("model*.safetensors"):
        shutil.copy(file, mixed)
    assert len(list(mixed.glob("*.safetensors"))) == (4 if leftover == "model.safetensors" else 5)
    ids = tokenizer.encode(TEXT).ids
    li.load(mixed)
    ours = li.forward(ids, [None] * li.N_LAYERS, 0)
    li.load(new)
    assert mx.array_equal(ours, li.forward(ids, [None] * li.N_LAYERS, 0)).item()
    assert rel_err(ours, mlx_lm_logits(new, ids)) < 1e-4
    r = run_cli("--model", str(mixed), "-m", "3")
    assert r.returncode == 0, r.stderr


def test_untied_model_without_its_head(broken):
    """tie_word_embeddings is false and lm_head.weight is missing: not the embedding, silently."""
    path = broken / "model.safetensors"
    w = mx.load(str(path))
    del w["lm_head.weight"]
    save_weights(path, w, metadata={"format": "pt"})
    assert_error(run_cli("--model", str(broken)), f"tensor lm_head.weight is missing in {broken} "
                 "(tie_word_embeddings is false); expected shape (640, 64)")


def test_broken_link_where_a_file_belongs(broken):
    """A Hugging Face cache whose blob was deleted: the link is there, what it names is not."""
    (broken / "model.safetensors").unlink()
    (broken / "model.safetensors").symlink_to("../../blobs/3f1a9c")
    assert_error(run_cli("--model", str(broken)), f"{broken / 'model.safetensors'} is a broken link"
                 " to ../../blobs/3f1a9c: download it again")


@pytest.mark.parametrize("entry, value", [
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6})])
def test_a_scaled_rope_other_than_yarn(broken, entry, value):
    """YaRN runs (tests/test_yarn.py); another scaling of RoPE is refused, the entry named as the
    file names it."""
    edit_json(broken / "config.json", lambda cfg: cfg | {entry: value})
    r = run_cli("--model", str(broken), "-m", "3")
    assert_error(r, f"{broken / 'config.json'}: {entry} is {{\"rope_type\": \"{value['rope_type']}\"",
                 'this script runs YaRN ("rope_type": "yarn") alone of the scaled RoPEs')


@pytest.mark.parametrize("entry, value, what", [
    ("attention_bias", True, "biases in the attention projections"),
    ("hidden_act", "gelu", "an activation other than SiLU"),
    ("use_sliding_window", True, "sliding-window attention"),
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]},
     "weights quantised in this format"),
])
def test_config_entry_that_changes_the_math(broken, entry, value, what):
    """Entries the script would otherwise ignore, computing another model than the one described."""
    edit_json(broken / "config.json", lambda cfg: cfg | {entry: value})
    r = run_cli("--model", str(broken), "-m", "3")
    shown = "rope_scaling" if entry == "rope_parameters" else entry  # the nested form, named so
    assert_error(r, f"{broken / 'config.json'}: {shown} is {li.shown_json(value)}: this script "
                 f"does not run {what}")
    assert r.stdout == ""


def test_weight_that_is_not_finite(broken):
    path = broken / "model.safetensors"
    w = mx.load(str(path))
    w["model.layers.1.mlp.down_proj.weight"][3, 5] = mx.nan
    save_weights(path, w, metadata={"format": "pt"})
    r = run_cli("--model", str(broken), "-m", "3")
    assert_error(r, f"tensor model.layers.1.mlp.down_proj.weight in {path} holds NaN or inf: "
                 "the file is damaged; download it again")
    assert r.stdout == ""


def test_weight_that_does_not_fit_float16(checkpoint, tmp_path):
    """bfloat16 holds 1e6, float16 does not (65504 at most): --dtype float16 says so at load."""
    folder = Path(shutil.copytree(checkpoint(dtype="bfloat16"), tmp_path / "m"))
    w = mx.load(str(folder / "model.safetensors"))
    w["model.embed_tokens.weight"][7, 1] = 1e6
    save_weights(folder / "model.safetensors", w, metadata={"format": "pt"})
    assert run_cli("--model", str(folder), "-m", "2").returncode == 0
    assert_error(run_cli("--model", str(folder), "-m", "2", "--dtype", "float16"),
                 "tensor model.embed_tokens.weight in", "holds NaN or inf: its values are too large "
                 "for float16 (float32 holds them)")


@pytest.fixture
def overflowing(checkpoint, tmp_path):
    """float32 weights that float16 holds (the largest is 1,000) but whose activations pass its
    largest value, 65504: the first feed-forward's input gain is 1,000, so silu(gate) * up is of
    order 1e5 there."""
    folder = Path(shutil.copytree(checkpoint(), tmp_path / "m"))
    w = mx.load(str(folder / "model.safetensors"))
    w["model.layers.0.post_attention_layernorm.weight"] *= 1000
    save_weights(folder / "model.safetensors", w, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("flags, where", [([], "after the prompt"), (["--show-probs", "3"], "after the prompt"),
                                          (["--explain"], "after the prompt")])
def test_activations_that_overflow_float16(overflowing, flags, where):
    """In float32 the model runs; in float16 its numbers overflow. Today's line names where the
    logits went NaN or inf and the dtype; it used to print a run of token 0 ("!!!!")."""
    assert run_cli("--model", str(overflowing), "-m", "3", *flags).returncode == 0
    r = run_cli("--model", str(overflowing), "-m", "3", "--dtype", "float16", *flags)
    assert_error(r, f"the logits {where} are not finite (NaN or inf) in float16: the activations "
                 "overflow it; compute in float32 (--dtype float32)")
    assert "!!!" not in r.stdout and "==========" not in r.stdout  # not a word of text


def test_chat_with_a_tokenizer_without_chat_tokens(broken):
    """A base model's tokenizer has no <|im_start|>: --chat would send the tags as plain text."""
    tok = json.loads((broken / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] not in ("<|im_start|>", "<|im_end|>")]
    (broken / "tokenizer.json").write_text(json.dumps(tok))
    r = run_cli("--model", str(broken), "--chat", "--prompt", "Hi", "-m", "2")
    assert_error(r, f"{broken / 'tokenizer.json'} has no <|im_start|> token: --chat needs the chat "
                 "tokens of Qwen3's instruct models")
    assert r.stdout == ""
    assert run_cli("--model", str(broken), "--prompt", "Hi", "-m", "2").returncode == 0


def test_prompt_argument_that_is_not_utf8(checkpoint):
    r = subprocess.run([sys.executable, str(ROOT / "llm_inference.py"), "--model", str(checkpoint()),
                        "--prompt", b"caf\xe9 au lait"], capture_output=True, timeout=120)
    r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()
    assert_error(r, "--prompt is not UTF-8 text (invalid continuation byte at byte 3)")


# The standard streams, closed or full (issue 35): one line, exit status 1, no traceback.
def run_redirected(folder, *flags, redirect, env=None):
    """The command line through bash, its streams redirected as `redirect` says (`> /dev/full`,
    `>&-`, `<&-`): stderr captured, and stdout unless the redirection takes it."""
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, str(ROOT / "llm_inference.py"), "--model",
                                            str(folder), *flags]) + " " + redirect
    env = dict(os.environ, PYTHONIOENCODING="utf-8", **(env or {}))
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=120)


def assert_one_line(r, *needles):
    """assert_error(), and exit status 1 exactly, nothing of Python's own on stderr."""
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert_error(r, *needles)


@pytest.mark.parametrize("env", [{}, {"PYTHONUNBUFFERED": "1"}], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("flags", [[], ["--quiet"]], ids=["stats", "quiet"])
def test_standard_output_on_a_full_disk(checkpoint, env, flags):
    """`> /dev/full`: every write fails (ENOSPC), at a flush or at once when unbuffered. One line
    names standard output and the cause (once Python's own traceback: issue 35)."""
    r = run_redirected(checkpoint(), "-m", "3", *flags, redirect="> /dev/full", env=env)
    assert_one_line(r, "standard output", "no space left on device")


def test_standard_output_closed(checkpoint):
    """`>&-`: nothing could be shown; once it ran to the end silently, exit status 0."""
    r = run_redirected(checkpoint(), "-m", "3", redirect=">&-")
    assert_one_line(r, "error: standard output is closed")


@pytest.mark.parametrize("flags", [["--prompt", "-"], ["--chat"]])
def test_closed_standard_input_where_the_prompt_comes_from(checkpoint, flags):
    """Started with standard input closed (`<&-`) where the prompt is read from it: one line
    (once Python's AttributeError on None), no text generated."""
    r = run_redirected(checkpoint(), *flags, "-m", "2", redirect="<&-")
    assert_one_line(r, "error: standard input is closed")
    assert "==========" not in r.stdout


def test_closed_standard_input_when_it_is_not_needed(checkpoint):
    cmd = f"{sys.executable} {ROOT / 'llm_inference.py'} --model {checkpoint()} --prompt Hi -m 2 <&-"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Generation: 2 tokens" in r.stdout, r.stderr


def test_prompts_file_that_does_not_exist(checkpoint, tmp_path):
    """--prompts FILE missing: the line names the file as given (once `error: . lacks nothere.txt`,
    the folder "." and the file apart, as for a model's files)."""
    r = run_cli("--model", str(checkpoint()), "--prompts", "nothere.txt", cwd=tmp_path)
    assert_one_line(r, "nothere.txt", "does not exist")
    assert not r.stderr.startswith("error: . lacks"), r.stderr


@pytest.mark.parametrize("weight_map", ["missing", [], "model-00001-of-00003.safetensors"],
                         ids=["missing", "a list", "a string"])
def test_index_without_a_weight_map(checkpoint, tmp_path, weight_map):
    """model.safetensors.index.json without a "weight_map" object: one line naming the index and
    its entry (once a KeyError's traceback, or an AttributeError's)."""
    folder = Path(shutil.copytree(checkpoint(shards=3), tmp_path / "sharded"))
    index = folder / "model.safetensors.index.json"
    edit_json(index, lambda data: {k: v for k, v in data.items() if k != "weight_map"}
              | ({} if weight_map == "missing" else {"weight_map": weight_map}))
    r = run_cli("--model", str(folder), "-m", "2")
    assert_one_line(r, str(index), "weight_map")
    assert r.stdout == ""
