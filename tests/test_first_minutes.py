"""The first minutes of a reader who comes from the article (issue 35): the article's four files,
a --model spelt as a path that does not exist, the Hugging Face cache kept clean, the README's
random checkpoint. Never a real network: the stand-in Hub (tests/hub.py) on 127.0.0.1, and
name lookups made to fail inside the process."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import llm_inference as li
from hub import StandInHub, flip
from test_cli_errors import ROOT, assert_error, run_cli
from test_download import NO_LOOKUP, SHARDED, environment

ARTICLE = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_the_articles_four_files_run_offline(checkpoint, tmp_path):
    """Qwen3-0.6B/ beside the script with the article's four files, no generation_config.json, and
    no network: it runs, asks nothing, and prints exactly what the five files print."""
    clone = tmp_path / "clone"
    (clone / "Qwen3-0.6B").mkdir(parents=True)
    shutil.copy(ROOT / "llm_inference.py", clone)
    for name in ARTICLE:
        shutil.copy(Path(checkpoint()) / name, clone / "Qwen3-0.6B" / name)
    (tmp_path / "no_lookup").mkdir()
    (tmp_path / "no_lookup" / "sitecustomize.py").write_text(NO_LOOKUP)
    env = dict(PYTHONPATH=str(tmp_path / "no_lookup"), HF_HOME=str(tmp_path / "hf"),
               HF_ENDPOINT="https://huggingface.co")
    r = run_cli("-m", "5", env=env, script=clone / "llm_inference.py")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    whole = run_cli("--model", str(checkpoint()), "-m", "5")
    assert r.stdout.split("==========")[1] == whole.stdout.split("==========")[1]


def test_without_generation_config_both_eos_ids_stop(checkpoint, tmp_path, tokenizer):
    """config.json names <|im_end|> only; generation_config.json adds <|endoftext|>. Without that
    file, both still end the generation (Qwen3's two EOS ids)."""
    folder = Path(shutil.copytree(checkpoint(), tmp_path / "model"))
    (folder / "generation_config.json").unlink()
    li.load_checked(folder)
    assert li.EOS_IDS == {tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")}


def test_generation_config_adds_its_eos_ids(checkpoint, tmp_path, tokenizer):
    """With generation_config.json, its eos_token_id ends the generation too (an id of its own)."""
    folder = Path(shutil.copytree(checkpoint(), tmp_path / "model"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5]}))
    li.load_checked(folder)
    assert 5 in li.EOS_IDS and tokenizer.token_to_id("<|im_end|>") in li.EOS_IDS


@pytest.mark.parametrize("spelling", ["./mymodel", "../mymodel", "a/b/c/d", "mymodel", "x/"])
def test_a_folder_that_does_not_exist(tmp_path, spelling):
    """However it is spelt, a folder that does not exist says so in one line; only a plain
    owner/name is taken for a repo id."""
    cwd = tmp_path / "here"
    cwd.mkdir()
    r = run_cli("--model", spelling, cwd=cwd, env=dict(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path)))
    assert_error(r, f"{(cwd / spelling).resolve()} does not exist (--model takes a folder, or a "
                 "Hugging Face repo id such as Qwen/Qwen3-0.6B)")


def sharded_repo(checkpoint, tmp_path, xet=False):
    """A stand-in Hub serving a two-shard Qwen/Qwen3-1.7B (on Xet storage, or plain), and the
    command that runs a fresh clone of the script on it -> (hub, command)."""
    hub = StandInHub(xet=xet)
    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copy(ROOT / "llm_inference.py", clone)
    hub.add_repo("Qwen/Qwen3-1.7B", checkpoint(shards=2, seed=3), SHARDED)
    return hub, [sys.executable, str(clone / "llm_inference.py"), "-m", "3", "--model",
                 "Qwen/Qwen3-1.7B"]


@pytest.mark.parametrize("xet", [False, True], ids=["plain", "xet"])
def test_a_damaged_file_leaves_nothing_in_the_cache(checkpoint, tmp_path, xet):
    """A repo id's shard served damaged: removed from the Hugging Face cache, its blob too (not
    only the link; on Xet storage, huggingface_hub's shared store of its files, where the blob's
    link leads), so that nothing of it is read later; the next run fetches it again."""
    hub, cmd = sharded_repo(checkpoint, tmp_path, xet)
    try:
        hub.corrupt.add(SHARDED[-1])
        r = subprocess.run(cmd, env=environment(hub, tmp_path / "hf"), capture_output=True, text=True)
        assert r.returncode == 1 and "damaged on the way, removed" in r.stderr, r.stderr
        damaged = flip(hub.repos["Qwen/Qwen3-1.7B"][SHARDED[-1]])
        assert all(f.read_bytes() != damaged for f in (tmp_path / "hf").rglob("*") if f.is_file())
        assert all(f.exists() for f in (tmp_path / "hf").rglob("*"))  # no link left to nothing
        hub.corrupt.clear()
        r = subprocess.run(cmd, env=environment(hub, tmp_path / "hf"), capture_output=True, text=True)
        assert r.returncode == 0 and r.stderr.splitlines()[1].startswith(SHARDED[-1]), r.stderr
    finally:
        hub.close()


def test_a_repo_id_in_the_cache_without_its_weights(checkpoint, tmp_path):
    """The cache holds a repo's configs but not its weights (an earlier, partial fetch): it is not
    taken as whole; the run fetches what is missing."""
    hub, cmd = sharded_repo(checkpoint, tmp_path)
    try:
        hub.status[SHARDED[-1]] = 404
        r = subprocess.run(cmd, env=environment(hub, tmp_path / "hf"), capture_output=True, text=True)
        assert r.returncode == 1 and "404" in r.stderr
        hub.status.clear()
        hub.requests.clear()
        r = subprocess.run(cmd, env=environment(hub, tmp_path / "hf"), capture_output=True, text=True)
        assert r.returncode == 0 and r.stderr.splitlines()[1].startswith(SHARDED[-1]), r.stderr
        assert len(r.stderr.splitlines()) == 2  # the repo's line, then only what was missing
    finally:
        hub.close()


def test_the_default_folder_takes_its_five_files_only(checkpoint, tmp_path):
    """The Hub's Qwen/Qwen3-0.6B holds more than the script reads (a model card, a merges file):
    the default folder gets the five files, generation_config.json among them, nothing else."""
    hub = StandInHub()
    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copy(ROOT / "llm_inference.py", clone)
    release = Path(shutil.copytree(checkpoint(), tmp_path / "release"))
    (release / "README.md").write_text("a model card")
    (release / "vocab.json").write_text("{}")
    try:
        hub.add_repo("Qwen/Qwen3-0.6B", release, sorted(p.name for p in release.iterdir()))
        r = subprocess.run([sys.executable, str(clone / "llm_inference.py"), "-m", "3"],
                           env=environment(hub, tmp_path / "hf"), capture_output=True, text=True)
    finally:
        hub.close()
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (clone / "Qwen3-0.6B").iterdir() if p.name != ".cache") == sorted(
        ARTICLE + ["generation_config.json"])
