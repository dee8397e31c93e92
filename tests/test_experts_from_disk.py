"""Experts from disk (Part II): a mixture whose weights exceed --memory keeps a pool of expert slots
a block and reads the experts it picks that no slot holds by their byte ranges in the safetensors
files. The answer is the resident run's, bit for bit in float32 greedy, on each layout a user
meets (Qwen3-MoE's one tensor an expert, Qwen3.5-MoE's stacked release, MLX's 4-bit switch_mlp);
in a batch, drafting and --explain too; the child process's peak resident memory (the operating
system's count, from outside) stays under the budget plus a margin measured the same way; a file
changed or cut after loading, a pool too small, a dense model over --memory: one line, exit 1."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import llm_inference as li
from test_cli_errors import assert_error, run_cli

TEXT = "The capital of France is Paris. The capital of Japan is Tokyo. Once upon a time there " \
       "was a small model that learned"  # 42 tokens: the prefill sorts its picks by expert


def streamed_names():
    """The resident model's tensors that stream: the experts of model.layers' mixture blocks."""
    return [name for name, w in li.W.items() if name.startswith("model.layers.") and
            ".mlp.experts." in name and int(name.split(".")[2]) < li.N_LAYERS]


def budget(folder, slots, dtype=None):
    """The --memory, in bytes, at which each block holds `slots` experts: the rest of the model
    plus that many of each block's, measured on a resident load of the folder."""
    li.load_checked(folder, dtype)
    experts = sum(li.W[name].nbytes for name in streamed_names())
    total = sum(w.nbytes for w in {id(w): w for w in li.W.values()}.values())
    blocks, e = len(li.MOE["layers"]), li.MOE["num_experts"]
    return total - experts + slots * experts / e + blocks  # (a byte a block over: rounding)


def converted(qwen3_moe, tmp_path):
    """mlx_lm convert's 4-bit Qwen3-MoE (switch_mlp.*, weights, scales and biases, stacked)."""
    from mlx_lm.convert import convert
    out = tmp_path / "q4"
    if not out.exists():
        convert(str(qwen3_moe()), str(out), quantize=True, q_group_size=32, q_bits=4)
    return out


@pytest.mark.parametrize("layout", ["one tensor an expert", "stacked", "switch_mlp 4-bit"])
def test_a_streamed_mixture_is_the_resident_ones(qwen3_moe, qwen35_moe, tokenizer, tmp_path,
                                                 layout):
    """3 of 8 experts a block in memory: the prompt's logits and 24 greedy tokens equal the
    resident run's exactly (float32); the pools read experts, and found some of their picks."""
    folder = {"one tensor an expert": qwen3_moe, "stacked": qwen35_moe}.get(
        layout, lambda: converted(qwen3_moe, tmp_path))()
    ids = tokenizer.encode(TEXT).ids
    memory = budget(folder, 3, mx.float32)
    logits = li.forward(ids, [None] * li.N_LAYERS, 0)
    tokens = list(li.generate(ids, 24))
    cfg = li.load_checked(folder, mx.float32, memory=memory)
    assert li.POOLS and {pool.size for pool in li.POOLS.values()} == {3}
    assert all(li.W[name].shape[0] == 3 for pool in li.POOLS.values() for name in pool.spans)
    assert "experts from disk: 3 of 8 a block in memory" in li.summary(folder, cfg)
    assert mx.array_equal(li.forward(ids, [None] * li.N_LAYERS, 0), logits).item()
    assert list(li.generate(ids, 24)) == tokens
    counts = [pool.counts for pool in li.POOLS.values()]
    assert all(c["bytes"] > 0 and 0 < c["found"] < c["wanted"] for c in counts), counts


@pytest.mark.parametrize("at_once", [1, 3, 8])
def test_each_slot_holds_the_expert_it_is_said_to(qwen3_moe, tokenizer, monkeypatch, at_once):
    """After a run, every slot's tensors equal the resident stack's rows of the expert the pool
    says it holds: the byte ranges are each expert's, not a neighbour's; whether the 5 slots'
    experts are read one at a time, 3 or 8 at once."""
    folder = qwen3_moe()
    memory = budget(folder, 5)
    resident = {name: li.W[name] for name in streamed_names()}
    li.load_checked(folder, memory=memory)
    monkeypatch.setattr(li, "READS_AT_ONCE", at_once)
    list(li.generate(tokenizer.encode(TEXT).ids, 8))
    for pool in li.POOLS.values():
        assert len(pool.slot_of) == 5
        for name in pool.spans:
            for e, slot in pool.slot_of.items():
                assert mx.array_equal(li.W[name][slot], resident[name][e]).item(), (name, e)


def test_a_read_that_fails_leaves_no_slot_claiming_what_it_does_not_hold(qwen3_moe, tokenizer,
                                                                          monkeypatch):
    """A pool reads 4 missing experts at once; expert 2's read fails (a UserError, as a changed
    file gives): the error comes through, no slot is said to hold an expert (0 and 1 were written
    in, 2 and 3 not), the counts keep the bytes written, and the next run over the same pools
    (the file whole again) is the resident one's."""
    folder = qwen3_moe()
    ids, memory = tokenizer.encode(TEXT).ids, budget(folder, 4)
    tokens = list(li.generate(ids, 8))
    li.load_checked(folder, memory=memory)
    pool, fill = next(iter(li.POOLS.values())), li.Pool.fill

    def failing(self, e, buffers, intervals):  # expert 2 of any pool fails
        if e == 2:
            raise li.UserError("a read failed")
        return fill(self, e, buffers, intervals)
    monkeypatch.setattr(li.Pool, "fill", failing)
    with pytest.raises(li.UserError, match="a read failed"):
        pool.bring([0, 1, 2, 3])
    assert pool.slot_of == {}, pool.slot_of
    one = sum(li.W[name][0].nbytes for name in pool.spans)  # an expert's bytes
    assert pool.counts["bytes"] == 2 * one and pool.counts["seconds"] > 0, pool.counts
    monkeypatch.setattr(li.Pool, "fill", fill)
    assert list(li.generate(ids, 8)) == tokens


def test_the_disks_time_counts_reads_under_way_at_once_once():
    """under_way(): the seconds some read was under way, overlaps counted once, gaps not."""
    assert li.under_way([(1.0, 3.0), (0.0, 2.0), (5.0, 6.0), (5.5, 5.75)]) == 4.0
    assert li.under_way([]) == 0.0


def test_a_batch_and_drafting_stream_as_they_run_resident(qwen3_moe, tokenizer):
    """generate_batch() and generate_draft() over the pools give the resident run's tokens."""
    folder = qwen3_moe()
    prompts = [tokenizer.encode(t).ids for t in (TEXT, "Once upon a time", "1, 2, 3, 1, 2, 3,")]
    memory = budget(folder, 4)
    batch = sorted(li.generate_batch(prompts, 12, batch_size=2))
    drafted = list(li.generate_draft(prompts[2], 16))
    li.load_checked(folder, memory=memory)
    assert li.POOLS
    assert sorted(li.generate_batch(prompts, 12, batch_size=2)) == batch
    assert list(li.generate_draft(prompts[2], 16)) == drafted


def test_the_command_line_says_the_pool_and_what_it_read(qwen3_moe):
    """--memory below the weights: the model's line names the pool, the statistics what the pools
    found and read; the text is the resident run's; --explain runs over the pools too."""
    folder = str(qwen3_moe())
    memory = budget(Path(folder), 3)
    resident = run_cli("--model", folder, "-m", "12")
    r = run_cli("--model", folder, "-m", "12", "--memory", f"{memory / 1e9:.9f}")
    assert r.returncode == 0, r.stderr
    assert "experts from disk: 3 of 8 a block in memory" in r.stdout.splitlines()[0]
    assert r.stdout.split("==========")[1] == resident.stdout.split("==========")[1]
    weights = [re.search(r"Bytes per token: ([\d.]+) MB of weights", run.stdout)[1]
               for run in (r, resident)]
    assert weights[0] == weights[1]  # a pool's k of S slots: the k experts' bytes, as resident
    line = next(line for line in r.stdout.splitlines() if line.startswith("Experts from disk: "))
    parts = (r"([\d.]+) MB read a token at ([\d.]+) GB/s; a token took ([\d.]+) ms, where "
             r"([\d.]+) computing \+ the MB ÷ the GB/s predict ([\d.]+) ")
    mb, speed, took, computing, predicted = (float(x) for x in re.search(parts, line).groups())
    assert mb > 0 and 0 < computing <= predicted <= took + 0.1, line  # reads within the pools'
    # time; ms = MB / (GB/s), each figure as printed, rounded: the interval they allow must hold it
    low, high = (mb - 0.005) / (speed + 0.005), (mb + 0.005) / max(speed - 0.005, 1e-9)
    assert low - 0.1 <= predicted - computing <= high + 0.1, line
    assert "of the picks found in memory" in line and "GB resident at most" in line
    explained = run_cli("--model", folder, "-m", "6", "--memory", f"{memory / 1e9:.9f}",
                        "--explain")
    assert explained.returncode == 0 and "the experts at work" in explained.stdout, \
        explained.stderr
    held = re.findall(r"^block \d+ .* used; busiest.*; held (\d+)%$", explained.stdout, re.M)
    assert len(held) == 3 and all(0 < int(share) < 100 for share in held), explained.stdout


def test_a_pool_too_small_names_the_least_that_works(qwen3_moe):
    """Under the rest of the model and one token's experts (2 a block): refused in one line that
    names the least --memory that works; that figure runs, and holds 2 experts a block."""
    folder = str(qwen3_moe())
    r = run_cli("--model", folder, "-m", "2", "--memory", "0.0001")
    assert_error(r, "--memory 0.0001 GB cannot hold the model without its experts",
                 "the least that works is --memory ")
    least = r.stderr.split("the least that works is --memory ")[1].split()[0]
    ok = run_cli("--model", folder, "-m", "2", "--memory", least)
    assert ok.returncode == 0 and "experts from disk: 2 of 8" in ok.stdout, ok.stderr
    one = budget(Path(folder), 1)  # room for 1 expert a block, where a token picks 2
    assert_error(run_cli("--model", folder, "-m", "2", "--memory", f"{one / 1e9:.9f}"),
                 "the least that works is --memory ")


@pytest.mark.parametrize("fault", ["touched", "cut short", "removed"])
def test_a_weights_file_changed_after_loading_is_one_line(qwen3_moe, tmp_path, fault):
    """The experts' places are read at load: a file touched (its time), cut short or removed
    since then stops the answer at its next read with one error naming the file, never a
    token from other bytes."""
    folder = Path(shutil.copytree(qwen3_moe(), tmp_path / "m"))
    memory = budget(folder, 2)
    li.load_checked(folder, memory=memory)
    file = folder / "model.safetensors"
    if fault == "touched":
        os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 10**9))
    elif fault == "cut short":
        os.truncate(file, file.stat().st_size - 1000)
    else:
        file.unlink()
    words = "cannot be read: no such file" if fault == "removed" else "has changed since it was"
    with pytest.raises(li.UserError, match=f"{file}.*{words}"):
        list(li.generate(li.tokenize(TEXT), 8))


def test_a_dense_model_over_memory_is_refused(checkpoint):
    """A dense model has no experts to leave on disk: --memory below its weights is refused in
    one line with both sizes; --memory 0 or less is a bad flag."""
    r = run_cli("--model", str(checkpoint()), "--memory", "0.0001")
    assert_error(r, "the weights are ", "more than --memory 0.0001 GB", "a quantised folder")
    assert_error(run_cli("--memory", "0"), "--memory must be more than 0")


def test_several_processes_are_refused_experts_from_disk(qwen3_moe):
    """Under mlx.launch each rank holds 1/N of every expert: streaming is refused in one line."""
    class Two:  # a group of two processes, as mx.distributed's, for the checks before any read
        def size(self):
            return 2

        def rank(self):
            return 0
    folder = qwen3_moe()
    memory = budget(folder, 3)
    with pytest.raises(li.UserError, match="experts from disk run in one process"):
        li.load_checked(folder, memory=memory, group=Two())


MEASURE = r"""
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = child.stderr.read()
_, status, usage = os.wait4(child.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss, err.decode()[-500:], sep="\n")
"""


def peak_rss(*flags):
    """The llm_inference.py child's exit status and peak resident memory in bytes, measured
    from outside: its parent waits for it with os.wait4, which gives that child's rusage."""
    out = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, li.__file__, *flags],
                         capture_output=True, text=True, timeout=300)
    status, kb, err = out.stdout.split("\n", 2)
    assert status == "0", err
    return int(kb) * (1 if sys.platform == "darwin" else 1024)


def test_a_mixture_two_and_a_half_times_the_budget_stays_under_it(qwen3_moe, checkpoint, tokenizer):
    """Weights of 105 MB (experts: 101 MB) under --memory 17 MB (2 of 16 experts a block): the
    child's peak resident memory stays under the budget plus a margin, and its tokens are the
    resident run's. The margin: the peak of the same command on a dense model of 3 MB, measured
    the same way (Python, MLX, the tokenizer, the cache, the activations), the reads' buffers
    (the bytes of as many experts as are read at once, at most READS_AT_ONCE and the pool's 2
    slots: 1.5 MB each; MLX's copy of one tensor as it goes into its slot, and the allocator
    keeps the last copy to reuse: 2 of the largest, gate_up's 1 MB), and a tenth of the budget
    (the allocator's rounding). The resident run's peak shows that the measure sees weights."""
    folder = qwen3_moe(num_hidden_layers=4, hidden_size=256, num_experts=16,
                       moe_intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64)
    li.load_checked(folder)
    weights = sum(w.nbytes for w in {id(w): w for w in li.W.values()}.values())
    memory = budget(folder, 2)
    assert weights >= 2.5 * memory, (weights, memory)
    flags = ["-m", "16", "-q", "--prompt", TEXT]
    base = peak_rss("--model", str(checkpoint()), *flags)
    streamed = peak_rss("--model", str(folder), "--memory", f"{memory / 1e9:.9f}", *flags)
    resident = peak_rss("--model", str(folder), *flags)
    tensors = [w.nbytes // len(w) for name, w in li.W.items() if ".mlp.experts." in name]
    reads = min(li.READS_AT_ONCE, 2) * sum(tensors) // li.N_LAYERS  # (one expert: a layer's)
    assert streamed < base + 1.1 * memory + reads + 2 * max(tensors), (streamed, base, memory)
    assert resident > base + 0.9 * weights, (resident, base, weights)
    same = run_cli("--model", str(folder), "--memory", f"{memory / 1e9:.9f}", *flags)
    assert same.stdout == run_cli("--model", str(folder), *flags).stdout


def test_a_chat_streams_as_it_runs_resident(qwen3_moe):
    """A piped chat of two turns (the second reusing the cache) over the pools: the resident
    chat's answers."""
    folder = str(qwen3_moe())
    memory = budget(Path(folder), 3)
    turns = b"hello there\nand then\n"
    resident = run_cli("--model", folder, "--chat", "-m", "6", "-q", stdin=turns)
    r = run_cli("--model", folder, "--chat", "-m", "6", "-q", "--memory", f"{memory / 1e9:.9f}",
                stdin=turns)
    assert r.returncode == 0 and resident.returncode == 0, r.stderr
    assert r.stdout == resident.stdout and r.stdout.count("\n") == 2, r.stdout  # two answers
