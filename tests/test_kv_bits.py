"""The KV cache in fewer bits (Part II): keys and values quantised as they enter the cache, in
groups along a head's width, once it holds --quantized-kv-start positions, and attention read
through mx.quantized_matmul. Greedy tokens equal mlx-lm's with the same flags on the same weights
(float32: the two order a scale's product differently, ~1e-7, far below these fixtures' gaps
between the likeliest logits), on dense Qwen3, Qwen3-MoE and Qwen3.5 (its DeltaNet state kept);
chat's reuse, drafting, several processes and a batch keep the cache in bits."""
import re
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

import llm_inference as li
from test_cli_errors import assert_error, run_cli

TEXT = "The capital of France is Paris. The capital of Japan is Tokyo. Once upon a time there " \
       "was a small model that learned"


def mlx_lm_tokens(folder, ids, n, bits, group, start):
    """mlx-lm's greedy ids after ids, n steps, with kv_bits, kv_group_size, quantized_kv_start."""
    model, _ = load_model(Path(folder))
    steps = generate_step(mx.array(ids), model, max_tokens=n, kv_bits=bits, kv_group_size=group,
                          quantized_kv_start=start)
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe", "qwen3_5"])
@pytest.mark.parametrize("bits, start", [(8, 0), (4, 0), (4, 20)])
def test_tokens_equal_mlx_lms_with_the_same_flags(checkpoint, qwen3_moe, qwen35, tokenizer, model,
                                                 bits, start):
    """The same flags, the same weights: our greedy ids are mlx-lm's (up to an EOS, which ours
    stops before); start 20 converts the cache inside the prompt (42 tokens), where mlx-lm
    does (both convert after a pass: the prompt's all but last, under 512 and 2,048 tokens)."""
    folder = {"qwen3": checkpoint, "qwen3_moe": qwen3_moe, "qwen3_5": qwen35}[model]()
    ids = tokenizer.encode(TEXT).ids
    li.load_checked(folder)
    cache = li.KVCache([None] * li.N_LAYERS, bits, 32, start)
    ours = list(li.generate(ids, 24, cache=cache))
    assert any(isinstance(entry, li.Quantized) for entry in cache)
    theirs = mlx_lm_tokens(folder, ids, 24, bits, 32, start)
    assert ours == theirs[:len(ours)] and (len(ours) == 24 or theirs[len(ours)] in li.EOS_IDS)


def test_the_cache_in_bits_is_the_bits_of_the_keys(checkpoint, tokenizer):
    """After the prompt, each layer's keys in bits are mx.quantize of the 16-bit run's keys for
    the positions both computed alike (all but the last, which reads a cache in bits), and Part
    II's dequantize() reads them back as MLX's mx.dequantize does."""
    li.load_checked(checkpoint())
    ids = tokenizer.encode(TEXT).ids
    plain, quantized = [None] * li.N_LAYERS, li.KVCache([None] * li.N_LAYERS, 8, 32, 0)
    li.prefill(ids, plain)
    li.prefill(ids, quantized)
    n = len(ids) - 1
    for entry, (keys, _) in zip(quantized, plain):
        want = mx.quantize(keys[:, :n], group_size=32, bits=8)
        got = [a[:, :n] for a in entry.keys]
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
        assert mx.allclose(li.dequantize(*got, 8), mx.dequantize(*want, group_size=32, bits=8),
                           atol=1e-6).item()


def test_drafting_and_a_chats_reuse_keep_the_cache_in_bits(checkpoint, tokenizer):
    """generate_draft() over a cache in bits gives generate()'s ids over one (both convert after
    the prompt); a continued cache (a chat's next turn) equals one filled in a single pass."""
    li.load_checked(checkpoint())
    ids = tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,").ids
    alone = list(li.generate(ids, 16, cache=li.KVCache([None] * li.N_LAYERS, 4, 32, 0)))
    drafted = list(li.generate_draft(ids, 16, cache=li.KVCache([None] * li.N_LAYERS, 4, 32, 0)))
    assert drafted == alone
    first, more = tokenizer.encode(TEXT).ids, tokenizer.encode(" And then").ids
    cache = li.KVCache([None] * li.N_LAYERS, 8, 32, 0)
    answer = list(li.generate(first, 6, cache=cache))
    again = list(li.generate(more, 6, cache=cache, start=len(first) + len(answer)))
    whole = li.KVCache([None] * li.N_LAYERS, 8, 32, 0)
    li.prefill(first, whole)  # the same conversion point: after the first prompt's pass
    assert list(li.generate(answer + more, 6, cache=whole, start=len(first)))[:len(again)] \
        == again


def test_the_mtp_heads_cache_is_in_bits_with_the_models(qwen35, tokenizer):
    """Qwen3.5's MTP head drafting over a model's cache in bits: its own cache goes into the same
    bits and groups (its layer's entry packed), and the ids are generate()'s over a cache in bits;
    a chat's next turn (the head's cache begun past position 0) too, from the command line."""
    folder = qwen35(mtp="agree", layers_scale=2.0)
    li.load_checked(folder)
    ids = tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,").ids
    alone = list(li.generate(ids, 12, cache=li.KVCache([None] * li.N_LAYERS, 4, 32, 0)))
    cache = li.KVCache([None] * li.N_LAYERS, 4, 32, 0)
    drafter = li.MTPDrafter(like=cache)
    assert list(li.generate_draft(ids, 12, drafter=drafter, cache=cache)) == alone
    entry = drafter.cache[li.N_LAYERS]
    assert isinstance(entry, li.Quantized) and li.kv_format(entry.keys, li.D_HEAD) == (4, 32)
    assert isinstance(li.MTPDrafter().cache, list) and not isinstance(li.MTPDrafter().cache,
                                                                          li.KVCache)
    later = li.KVCache([None] * li.N_LAYERS, 8, 32, 6)
    assert li.MTPDrafter(5, like=later).cache.quantized_start == 6
    bits = ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0"]
    chat = run_cli("--model", str(folder), "--chat", "--draft", "mtp", "-m", "4", *bits,
                   stdin=b"1, 2, 3\n1, 2\n")
    assert chat.returncode == 0 and chat.stdout.count("in 4 bits, groups of 32") == 2, chat.stderr


def test_the_command_line_says_the_bits_and_the_true_size(checkpoint):
    """--kv-bits 8 --kv-group-size 32 --quantized-kv-start 0: the KV cache line names the bits and
    counts the packed numbers, scales and biases: per position, per layer, keys and values,
    KV heads x (head_dim bytes at 8 bits + 2 x head_dim / 32 float32s)."""
    folder = str(checkpoint())
    r = run_cli("--model", folder, "-m", "8", "--kv-bits", "8", "--kv-group-size", "32",
                "--quantized-kv-start", "0")
    assert r.returncode == 0, r.stderr
    line = next(line for line in r.stdout.splitlines() if line.startswith("KV cache: "))
    li.load_checked(Path(folder))
    positions = int(line.split()[2])
    each = li.N_LAYERS * 2 * li.N_KV * (li.D_HEAD + 2 * li.D_HEAD // 32 * 4)
    assert f"positions in 8 bits, groups of 32, {positions * each / 1e6:.3f} MB" in line, line


def test_what_the_cache_in_bits_refuses(checkpoint):
    """A group that does not divide the heads' width, bits MLX does not pack: one line, exit 1."""
    folder = str(checkpoint())
    assert_error(run_cli("--model", folder, "--kv-bits", "4"), "--kv-group-size 64 does not divide")
    assert_error(run_cli("--kv-bits", "7"), "--kv-bits")


@pytest.mark.parametrize("model", ["qwen3", "qwen3_5"])
def test_a_batch_in_bits_is_each_row_alone_in_bits(checkpoint, qwen35, tokenizer, model):
    """A continuous batch (2 slots, 3 prompts of other lengths: a row joins mid-batch) over a
    cache in bits from its first pass: each row's greedy ids are its own run's over a cache in
    bits (mlx-lm keeps no batch's cache in bits); the command line's KV line says the bits."""
    folder = {"qwen3": checkpoint, "qwen3_5": qwen35}[model]()
    li.load_checked(folder)
    prompts = [tokenizer.encode(t).ids for t in (TEXT, "Once upon a time", "1, 2, 3, 1, 2,")]
    alone = [list(li.generate(ids, 10, cache=li.KVCache([None] * li.N_LAYERS, 4, 32, 0)))
             for ids in prompts]
    together = [[] for _ in prompts]
    for i, token in li.generate_batch(prompts, 10, batch_size=2,
                                      cache=li.KVCache([None] * li.N_LAYERS, 4, 32, 0)):
        together[i].append(token)
    assert together == alone
    r = run_cli("--model", str(folder), "-m", "6", "-p", "a b", "-p", "c d e", "--kv-bits", "4",
                "--kv-group-size", "32", "--quantized-kv-start", "0")
    assert r.returncode == 0 and " 2 sequences, 2 of them in 4 bits, " in r.stdout, r.stderr


def test_a_batch_that_turns_to_bits_counts_each_sequence_as_it_was_held(checkpoint):
    """One slot: a short prompt ends before the cache reaches --quantized-kv-start, the long one
    after it turns to bits: generate_batch() says which ended in bits, and the KV line counts the
    first's positions in the model's dtype, the second's in bits (packed numbers, a scale and a
    bias a group of 32), to the printed decimals."""
    folder = str(checkpoint())
    r = run_cli("--model", folder, "-m", "24", "-p", "a b", "-p", TEXT, "--batch-size", "1",
                "--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "40")
    assert r.returncode == 0, r.stderr
    found = re.search(r"KV cache: (\d+) positions in 2 sequences, 1 of them in 4 bits, ([\d.]+) MB",
                      r.stdout)
    assert found, r.stdout
    ended = []
    li.load_checked(folder)
    prompts = [li.TOK.encode(text).ids for text in ("a b", TEXT)]
    cache = li.KVCache([None] * li.N_LAYERS, 4, 32, 40)
    list(li.generate_batch(prompts, 24, batch_size=1, ended=ended, cache=cache))
    assert [(i, in_bits) for i, _, in_bits in ended] == [(0, False), (1, True)], ended
    (_, plain, _), (_, packed, _) = ended
    assert int(found[1]) == plain + packed, (found[1], ended)
    number, size = 2 * li.N_LAYERS * li.N_KV * li.D_HEAD, li.W["model.norm.weight"].dtype.size
    mb = (plain * size + packed * (0.5 + 2 * size / 32)) * number / 1e6  # a position's numbers
    assert abs(float(found[2]) - mb) <= 0.0005 + 1e-9, (found[2], mb)


def test_explain_and_a_chat_run_over_a_cache_in_bits(checkpoint):
    """--explain's views and a piped chat's second turn (its cache reused) over a cache in bits."""
    bits = ["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0"]
    folder = str(checkpoint())
    r = run_cli("--model", folder, "-m", "4", "--explain", *bits)
    assert r.returncode == 0 and "the answer forming" in r.stdout, r.stderr
    assert "[note: token" not in r.stdout  # the lens's pass in bits where the run's was: no tie
    chat = run_cli("--model", folder, "--chat", "-m", "4", *bits, stdin=b"hello\nand more\n")
    assert chat.returncode == 0, chat.stderr
    reused = [int(n) for n in re.findall(r"\[KV cache: (\d+) tokens reused", chat.stdout)]
    assert len(reused) == 2 and reused[1] > 0, chat.stdout
    assert chat.stdout.count("in 8 bits, groups of 32") == 2, chat.stdout
    explained = run_cli("--model", folder, "--chat", "-m", "4", "--explain", *bits,
                        stdin=b"hello\nand more\n")  # the second turn's lens: a cache in bits
    assert explained.returncode == 0, explained.stderr
    assert explained.stdout.count("the answer forming") == 2, explained.stdout


def test_a_cache_in_bits_written_again_before_its_start_stays_in_bits(checkpoint, tokenizer):
    """A cache converted at 30 positions, then reused from position 10 (a chat's next turn that
    shares 10, before quantized_start): its writes stay in bits (a write in the model's dtype
    into keys in bits would fail)."""
    li.load_checked(checkpoint())
    ids = tokenizer.encode(TEXT).ids
    cache = li.KVCache([None] * li.N_LAYERS, 8, 32, 30)
    list(li.generate(ids, 4, cache=cache))
    assert all(isinstance(entry, li.Quantized) for entry in cache)
    again = list(li.generate(ids[10:20], 6, cache=cache, start=10))
    assert all(isinstance(entry, li.Quantized) for entry in cache) and len(again) > 0
