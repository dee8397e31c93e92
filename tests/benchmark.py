"""Speed and memory of llm_inference.py next to mlx-lm, on the same weights, in one process.

    python tests/benchmark.py                        # bfloat16, Qwen3-0.6B's proportions, 4 layers
    python tests/benchmark.py --dtype float32        # with a fast BLAS: LD_PRELOAD=.../libblis.so.4
    python tests/benchmark.py --contexts 512,2048    # decode after these contexts only
    python tests/benchmark.py --layers 28            # Qwen3-0.6B's exact shapes (slow on a CPU)
    python tests/benchmark.py --model Qwen3-0.6B     # a real checkpoint
    python tests/benchmark.py --shape small          # 28 tiny layers: bound by the launch overhead
    python tests/benchmark.py --quantize 4           # the same, quantised by mlx-lm (groups of 64)
    python tests/benchmark.py --qwen35               # Qwen3.5-0.8B's proportions, 4 layers: 3 DeltaNet
    python tests/benchmark.py --moe --dtype float32  # Qwen3-30B-A3B's proportions, 2 layers of
                                                     # 128 experts (8 a token); --quantize 4 too
    python tests/benchmark.py --batches 1,4,16       # batching: ours, mlx-lm's batch_generate, B runs
    python tests/benchmark.py --batches 16,32 --no-plain-runs   # without the B plain runs
    python tests/benchmark.py --qwen35 --draft mtp   # drafting: heads that agree, half agree, random
    python tests/benchmark.py --draft lookup         # prompt lookup on Qwen3, a repetitive prompt
    python tests/benchmark.py --bandwidth            # --explain's memory figure beside numpy's copy
    python tests/benchmark.py --kv-bits 8 --contexts 4096,16384   # the KV cache in bits, both
                                                     # (from position 0), and its memory
    python tests/benchmark.py --kv-bits 8 --contexts 16384 --prefills '' --random-context
                                                     # decoding alone over 16k random keys (a
                                                     # 16k prefill in bits: over 40 min here)
    python tests/benchmark.py --moe --stream --dtype float32 --quantize 4   # experts from disk:
                                                     # pools of 99%-12.5%: resident, mlx-lm
    python tests/benchmark.py --moe --reads --layers 2   # its reads alone, 8 at once and 1
    python tests/benchmark.py --model Qwen3-0.6B --kv-quality   # the KV cache in bits: where the
                                                     # greedy answer parts from the plain cache's
    python tests/benchmark.py --ranks                # tensor parallel rows, one process; and two:
    mlx.launch -n 2 --python "$(which python)" -- tests/benchmark.py --ranks

Runs alternate between the two implementations (ours, mlx-lm, ours, mlx-lm, ...) after one
warm-up each, and each figure is the median over --runs. Prefill tokens/s = prompt tokens / time
to the first token; decode tokens/s = tokens after the first / the time they took.

Decode after a context of N tokens: each implementation prefills the N tokens once (untimed),
then every run decodes from that cache: ours from a copy of the cache list (a KV buffer is
written over after position N; a DeltaNet state, never changed in place, is the one after N);
mlx-lm's after trimming each KV cache back to N and putting each DeltaNet state back. With
--random-context the N positions are random keys and values written into each cache (a KV
model's only), in bits as each implementation's prefill would leave them, and no peak is compared.

Peak memory is each implementation's own at each context, prefill included: MLX's peak while it
ran, minus the weights of the other implementation, which sit in memory too.

Why 4 layers and a smaller vocabulary: Qwen3-0.6B's 28 layers make a 2,048-token prefill take
minutes on a 2-core CPU. A model with fewer layers but the full vocabulary would overstate the LM
head (a quarter of Qwen3-0.6B's weights, the same work in both implementations, so it pulls every
ratio towards 1). So the random checkpoint keeps the real proportions: --layers L of Qwen3-0.6B's
exact shape and a vocabulary of 151,936 x L / 28, so that the head is the same share of each
decode step as in the real model. --shape small is the other end: 28 layers of hidden 64, where each step's time goes to launching
kernels and Python's work between them rather than to arithmetic.

First it prints how many kernels one decoded token launches per layer, ours and mlx-lm's
(kernels_per_layer(): a graph count, so the same on every device). Not collected by pytest (no
test_ prefix).
"""
import argparse
import copy
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.utils import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import llm_inference as li  # noqa: E402
from conftest import QWEN3_06B, QWEN35_08B, build_tokenizer, write_checkpoint, write_qwen35  # noqa: E402
from moe_checkpoints import write_qwen3_moe  # noqa: E402

# Qwen3-30B-A3B's shapes (its config.json): 48 layers, each 128 experts of 768, 8 a token.
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, max_position_embeddings=40960, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768)

SMALL = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=28, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=640, max_position_embeddings=8192)
VIEWS = {"Reshape", "Transpose", "Broadcast", "ExpandDims", "Squeeze", "Slice", "AsStrided", "Flatten",
         "Unflatten"}  # primitives that only describe a view of memory: they launch no kernel


def kernels_per_layer(step, n_layers):
    """step(): one decoded token's logits, built lazily (an evaluated KV cache behind it) ->
    the kernels that computing them launches, per layer. Counted in MLX's graph of the step
    (mx.export_to_dot): every node but the views; a compiled function's fused node counts once,
    as does each mx.fast kernel and each distributed sum ("Sum AllReduce"). The embedding, final
    norm and LM head are in the count too."""
    with tempfile.TemporaryDirectory() as folder:
        mx.export_to_dot(f"{folder}/step.dot", step())
        names = re.findall(r'label ="([\w ]+)"', Path(f"{folder}/step.dot").read_text())
    return sum(name not in VIEWS for name in names) / n_layers


def ours_step():
    cache = [None] * li.N_LAYERS
    mx.eval(li.forward(list(range(16)), cache, 0))                    # 16 tokens in the cache
    return li.forward([5], cache, 16)[-1]                             # the 17th, lazily


def mlx_lm_step(model):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(16)[None], cache=cache),
            [c.cache if isinstance(c, ArraysCache) else c.state for c in cache])
    return model(mx.array([[5]]), cache=cache)[0, -1]


def timed(tokens, n_prompt):
    """Drain a token iterator -> (prefill tokens/s, decode tokens/s)."""
    start = time.perf_counter()
    first, n = None, 0
    for n, _ in enumerate(tokens, 1):
        first = first or time.perf_counter()
    end = time.perf_counter()
    return n_prompt / (first - start), (n - 1) / (end - first)


class Ours:
    def __init__(self, kv_bits=None):  # kv_bits: the cache in bits from position 0 (group 64)
        self.kv_bits = kv_bits

    def new_cache(self):
        if self.kv_bits is None:
            return [None] * li.N_LAYERS
        return li.KVCache([None] * li.N_LAYERS, self.kv_bits, 64, 0)

    def generate(self, ids, max_tokens):  # (a generator: li.generate() prefills when called,
        yield from li.generate(ids, max_tokens=max_tokens, cache=self.new_cache())  # timed here)

    def prefill(self, ids):
        cache = self.new_cache()
        mx.eval(li.prefill(ids, cache), cache)  # the cache holds exactly the ids
        return cache

    def decode(self, cache, start, token, max_tokens):
        yield from li.generate([token], max_tokens=max_tokens, cache=copy.copy(cache), start=start)

    def filled(self, n):  # --random-context: n positions of random keys and values, no prefill
        cache, dtype = self.new_cache(), li.W["model.norm.weight"].dtype
        for layer in range(li.N_LAYERS):
            k, v = mx.random.normal((2, n, li.N_KV, li.D_HEAD), dtype=dtype)
            li.cache_write(cache, layer, k, v, 0)  # (a first write: in the model's dtype)
            if self.kv_bits:  # into bits now, as mlx-lm's converts at its first step
                cache[layer] = li.to_bits(cache[layer], cache)
        mx.eval(cache)
        return cache


class MlxLm:
    def __init__(self, model, kv_bits=None):
        self.model, self.kv = model, {} if kv_bits is None else dict(
            kv_bits=kv_bits, kv_group_size=64, quantized_kv_start=0)

    def generate(self, ids, max_tokens):
        return (int(t) for t, _ in generate_step(mx.array(ids), self.model, max_tokens=max_tokens,
                                                 **self.kv))

    def prefill(self, ids):
        cache = make_prompt_cache(self.model)
        list(self.generate_with(cache, ids, 1))  # the cache holds exactly the ids
        self.states = {id(c): list(c.cache) for c in cache if isinstance(c, ArraysCache)}
        return cache

    def decode(self, cache, start, token, max_tokens):
        for c in cache:  # back to the context alone
            if isinstance(c, ArraysCache):
                c.cache = list(self.states[id(c)])
            else:
                c.trim(c.offset - start)
        return self.generate_with(cache, [token], max_tokens)

    def filled(self, n):  # --random-context: as Ours.filled()
        cache, self.states = make_prompt_cache(self.model), {}
        dtype = li.W["model.norm.weight"].dtype
        for c in cache:
            c.update_and_fetch(*mx.random.normal((2, 1, li.N_KV, n, li.D_HEAD), dtype=dtype))
        mx.eval([c.state for c in cache])
        return cache

    def generate_with(self, cache, ids, max_tokens):
        steps = generate_step(mx.array(ids), self.model, max_tokens=max_tokens, prompt_cache=cache,
                              **self.kv)
        return (int(t) for t, _ in steps)


class NoStop:  # what batch_generate asks of a tokenizer: no EOS id (every row makes its tokens)
    eos_token_ids = []

    def decode(self, ids):
        return ""


def batch_rows(model, batches, runs, plain=True, n_prompt=16, n_new=32):
    """Total generated tokens per second over B prompts of n_prompt tokens, n_new tokens each,
    prefill included: ours (generate_batch), mlx-lm's batch_generate, and B plain runs of ours one
    after another (plain=False: not those); interleaved, medians. EOS ids are set aside so that
    every row makes n_new."""
    li.EOS_IDS = set()
    vocab = li.TOK.get_vocab_size() - 10
    print(f"{'B':>3}{'ours':>10}{'mlx-lm':>10}{'ratio':>8}{'B runs':>10}{'ours/runs':>11}"
          f"{'kernels/row':>13}{'single':>8}")
    for B in batches:
        prompts = [[(7 * i + 13 * b + 3) % vocab for i in range(n_prompt)] for b in range(B)]
        figures = {"ours": [], "mlx-lm": [], "runs": []}
        ways = {"ours": lambda: list(li.generate_batch(prompts, n_new, batch_size=B)),
                "mlx-lm": lambda: batch_generate(model, NoStop(), prompts, max_tokens=n_new,
                                                 completion_batch_size=B, prefill_batch_size=B),
                "runs": lambda: [list(li.generate(ids, max_tokens=n_new)) for ids in prompts]}
        if not plain:
            ways.pop("runs")
            figures["runs"] = [float("nan")]
        for run in range(runs + 1):
            for name, way in ways.items():
                mx.clear_cache()
                tic = time.perf_counter()
                way()
                if run:  # run 0 is the warm-up
                    figures[name].append(B * n_new / (time.perf_counter() - tic))
        a, b, c = (statistics.median(figures[name]) for name in figures)
        print(f"{B:>3}{a:>10.2f}{b:>10.2f}{a / b:>7.2f}x{c:>10.2f}{a / c:>10.2f}x"
              f"{batch_kernels(prompts) / B:>13.1f}{batch_kernels(prompts[:1], single=True):>8.1f}")


def batch_kernels(prompts, single=False):
    """The kernels one decode step launches for these rows (a graph count, as kernels_per_layer):
    each prompt prefilled alone and put in its slot of one batch cache, as generate_batch() does."""
    cache, own = [None] * li.N_LAYERS, []
    for b, ids in enumerate(prompts):
        own = [None] * li.N_LAYERS
        mx.eval(li.prefill(ids, own), own)
        li.take_slots(cache, [b], [None if e is None else tuple(a[None] for a in e) for e in own])
    mx.eval(cache)
    if single:
        step = lambda: li.forward([5], own, len(prompts[0]))[-1]  # noqa: E731
    else:
        step = lambda: li.forward_batch(mx.array([5] * len(prompts)), cache,  # noqa: E731
                                        [len(ids) for ids in prompts])
    return kernels_per_layer(step, 1)


def draft_rows(folders, draft, runs, n_new=64):
    """Decode tokens/s after a 16-token prompt: plain (generate) and drafting (generate_draft),
    ours, and mlx-lm's plain decode on the same folder; the share of drafts accepted; and what a
    draft costs beside a plain step (the MTP head on one row against the model on one row)."""
    print(f"{'folder':<22}{'plain':>9}{'draft':>9}{'ratio':>8}{'mlx-lm':>9}{'accepted':>10}"
          f"{'draft/step':>12}")
    for label, folder in folders.items():
        li.load(folder)
        li.EOS_IDS = set()
        model, _ = load_model(Path(folder))
        vocab = li.TOK.get_vocab_size() - 10
        prompt = [(7 * i + 3) % vocab for i in range(8)] * 2 if draft == "lookup" else \
            [(7 * i + 3) % vocab for i in range(16)]
        figures, counts = {"plain": [], "draft": [], "mlx-lm": []}, {}
        ways = {"plain": lambda: li.generate(prompt, max_tokens=n_new),
                "draft": lambda: li.generate_draft(prompt, n_new, drafter=li.MTPDrafter() if
                                                   draft == "mtp" else li.PromptLookup(3),
                                                   counts=counts),
                "mlx-lm": lambda: MlxLm(model).generate(prompt, n_new)}
        for run in range(runs + 1):
            for name, way in ways.items():
                mx.clear_cache()
                counts.clear()
                speed = timed(way(), len(prompt))[1]
                if run:
                    figures[name].append(speed)
                if name == "draft":
                    accepted = counts["accepted"] / max(counts["drafted"], 1)
        a, b, c = (statistics.median(figures[name]) for name in ways)
        print(f"{label:<22}{a:>9.2f}{b:>9.2f}{b / a:>7.2f}x{c:>9.2f}{accepted:>9.0%}"
              f"{draft_cost() if draft == 'mtp' else 0.0:>11.2f}x")
        del model


def draft_cost(runs=10):
    """The MTP head on one row against the model's step on one row (median seconds, after 16)."""
    cache, mtp_cache = [None] * li.N_LAYERS, [None] * (li.N_LAYERS + 1)
    hidden = li.hidden_pass(list(range(16)), cache, 0)
    mx.eval(li.mtp_logits(mx.array(list(range(1, 16))), hidden[:-1], mtp_cache, 0), mtp_cache)
    times = {"head": [], "step": []}
    for _ in range(runs):
        for name in times:
            tic = time.perf_counter()
            if name == "head":
                mx.eval(li.mtp_logits(mx.array([5]), hidden[-1:], list(mtp_cache), 15))
            else:
                mx.eval(li.forward([5], list(cache), 16))
            times[name].append(time.perf_counter() - tic)
    return statistics.median(times["head"]) / statistics.median(times["step"])


def rank_rows(shape, dtype, runs):
    """Several processes (run under mlx.launch -n N; alone: N = 1): ours (load_checked with the
    group) against mlx-lm's own tensor parallelism (sharded_load, its shard()), decode tokens/s
    after a 16-token prompt, interleaved, medians of runs; the all-sums' share of our token's time
    (li.all_sum_seconds, as the statistics time it) and the kernels a decoded token launches."""
    from mlx_lm.utils import sharded_load
    group = mx.distributed.init()
    folder = write_checkpoint(tempfile.mkdtemp(), build_tokenizer(), dtype=dtype,
                              lm_head="tied_stored", init="realistic", **shape)  # the same weights
    li.load_checked(folder, None, group)                              # on every rank (seeded)
    model, _ = sharded_load(str(folder)) if group.size() > 1 else load_model(Path(folder))
    impls, rates = {"ours": Ours(), "mlx-lm": MlxLm(model)}, {}
    prompt = [(7 * i + 3) % 300 for i in range(16)]
    for run in range(runs + 1):
        for name, impl in impls.items():
            if run:  # run 0 is the warm-up
                rates.setdefault(name, []).append(timed(impl.generate(prompt, 33), 16)[1])
            else:
                timed(impl.generate(prompt, 33), 16)
    ours, theirs = (statistics.median(rates[name]) for name in impls)
    x = mx.zeros((1, li.D), li.W["model.norm.weight"].dtype)
    sums = li.all_sum_seconds(2 * li.N_LAYERS, x) if group.size() > 1 else 0.0
    kernels = (kernels_per_layer(ours_step, li.N_LAYERS),
               kernels_per_layer(lambda: mlx_lm_step(model), li.N_LAYERS))  # noqa: E731
    if group.rank() == 0:
        print(f"{mx.default_device()}, {group.size()} process(es), {li.N_LAYERS} layers, {dtype}, "
              f"runs={runs}")
        print(f"decode tokens/s after 16: ours {ours:.2f}, mlx-lm {theirs:.2f}, ratio "
              f"{ours / theirs:.2f}x; all-sums alone {sums * 1e3:.2f} ms a token, "
              f"{100 * sums * ours:.1f}% of ours")
        print(f"kernels a layer for one decoded token: ours {kernels[0]:.1f}, mlx-lm "
              f"{kernels[1]:.1f}")


def drop_page_cache():
    """Empty the operating system's page cache (Linux, as root), so that the next reads come from
    the disk itself -> whether it could."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def stream_rows(folder, runs, shares=(1.0, 0.5, 0.25, 0.125), n_prompt=16, n_new=32):
    """Experts from disk: decode tokens/s with every expert in memory, then with pools of a share
    of each block's experts (--memory set to the rest of the model plus that share; all but one
    expert added, the nearest to a pool of all, which --memory never makes), their missing
    experts read READS_AT_ONCE at a time and one at a time, interleaved with mlx-lm on the same
    folder, the page cache warm and (where allowed) dropped before each run; each pool's hit rate
    and the MB it read a token generated. The median of runs each."""
    model, _ = load_model(folder)
    mx.eval(model.parameters())
    li.load_checked(folder)
    streamed = [n for n in li.W if n.startswith("model.layers.") and ".mlp.experts." in n]
    experts = sum(li.W[n].nbytes for n in streamed)
    total = sum(w.nbytes for w in {id(w): w for w in li.W.values()}.values())
    e, k = li.MOE["num_experts"], li.MOE["num_experts_per_tok"]
    prompt = [(7 * i + 3) % (li.TOK.get_vocab_size() - 10) for i in range(n_prompt)]
    shares = sorted({*shares, 1 - 1 / e}, reverse=True)
    memory = {share: None if share == 1 else total - experts * (1 - share) + 64 for share in shares}
    at_once = li.READS_AT_ONCE
    ways = [(share, n) for share in shares for n in ((at_once,) if share == 1 else (at_once, 1))]
    cold = drop_page_cache()
    print(f"{mx.default_device()}, {li.N_LAYERS} layers of {e} experts ({k} a token), weights "
          f"{total / 1e9:.2f} GB, experts {experts / 1e9:.2f} GB; page cache dropped: "
          f"{'yes' if cold else 'not allowed here'}")
    rows, theirs = {}, []  # theirs: mlx-lm's tokens/s, its experts all in memory
    try:
        for run in range(runs + 1):
            for share, n in ways:
                for drop in (False, True) if cold else (False,):
                    li.load_checked(folder, memory=memory[share])
                    li.READS_AT_ONCE = n
                    if drop:
                        drop_page_cache()
                    _, decode = timed(li.generate(prompt, n_new + 1), n_prompt)
                    counts = [pool.counts for pool in li.POOLS.values()]
                    wanted = max(sum(c["wanted"] for c in counts), 1)
                    found = sum(c["found"] for c in counts) / wanted
                    read = sum(c["bytes"] for c in counts) / (n_new + 1)
                    if run:  # run 0 warms up
                        rows.setdefault((share, n, drop), []).append((decode, found, read))
            _, decode = timed(MlxLm(model).generate(prompt, n_new + 1), n_prompt)
            if run:
                theirs.append(decode)
    finally:
        li.READS_AT_ONCE = at_once
    print(f"{'pool':<22}{'at once':>8}{'tokens/s':>10}{'x resident':>12}{'x mlx-lm':>10}"
          f"{'held':>8}{'MB a token':>12}")
    resident = statistics.median(r[0] for r in rows[(1.0, at_once, False)])
    mlx_lm_decode = statistics.median(theirs)
    print(f"{'mlx-lm':<30}{mlx_lm_decode:>10.2f}{mlx_lm_decode / resident:>11.2f}x{1:>9.2f}x")
    for (share, n, drop), figures in rows.items():
        decode = statistics.median(f[0] for f in figures)
        label = "resident" if share == 1 else f"{share:.1%} of experts"
        held = statistics.median(f[1] for f in figures) if share < 1 else 1.0
        print(f"{label + (', cold' if drop else ''):<22}{n if share < 1 else '':>8}{decode:>10.2f}"
              f"{decode / resident:>11.2f}x{decode / mlx_lm_decode:>9.2f}x{held:>8.1%}"
              f"{statistics.median(f[2] for f in figures) / 1e6:>12.1f}")


def read_rows(folder, runs, share=0.5):
    """Experts from disk, the reads alone: one block's empty pool (share of its experts) brings
    as many experts in one call, READS_AT_ONCE at a time and one at a time, the page cache
    dropped first (where allowed) and warm: GB/s over the whole call (reads and the copies into
    the slots), and the disk's (bytes over the time a read was under way). Medians of runs."""
    li.load_checked(folder)
    streamed = [n for n in li.W if n.startswith("model.layers.") and ".mlp.experts." in n]
    total = sum(w.nbytes for w in {id(w): w for w in li.W.values()}.values())
    memory = total - sum(li.W[n].nbytes for n in streamed) * (1 - share) + 64
    at_once, rows, cold = li.READS_AT_ONCE, {}, drop_page_cache()
    try:
        for run in range(runs + 1):
            for n in (at_once, 1):
                for drop in (True, False) if cold else (False,):
                    li.load_checked(folder, memory=memory)
                    li.READS_AT_ONCE, pool = n, next(iter(li.POOLS.values()))
                    if drop:
                        drop_page_cache()
                    else:
                        for file in pool.files:  # warm: each file read whole once
                            Path(file).read_bytes()
                    tic = time.perf_counter()
                    pool.bring(list(range(pool.size)))
                    seconds, c = time.perf_counter() - tic, pool.counts
                    if run:
                        rows.setdefault((n, drop), []).append((c["bytes"] / seconds,
                                                               c["bytes"] / c["disk"]))
    finally:
        li.READS_AT_ONCE = at_once
    print(f"one block's {pool.size} experts into an empty pool, "
          f"{pool.counts['bytes'] / 1e6:.0f} MB:")
    print(f"{'reads':<22}{'GB/s, the call':>16}{'the disk':>10}")
    for (n, drop), figures in rows.items():
        print(f"{f'{n} at once' + (', cold' if drop else ', warm'):<22}"
              f"{statistics.median(f[0] for f in figures) / 1e9:>16.2f}"
              f"{statistics.median(f[1] for f in figures) / 1e9:>10.2f}")


def kv_quality_rows(n_prompt=4096, n_new=256):
    """What the KV cache in bits costs in quality, on the weights loaded (a trained model's: on
    random ones the logits tie everywhere and any change parts the answers at once): a long
    prompt (this README, again and again), the greedy answer over a cache in 8 and 4 bits from
    position 0, groups of 64 and 32, against the model's own dtype's; where each parts from it."""
    ids = li.TOK.encode((Path(__file__).parent.parent / "README.md").read_text()).ids
    prompt = (ids * (n_prompt // len(ids) + 1))[:n_prompt]
    plain = list(li.generate(prompt, n_new))
    print(f"{mx.default_device()}, {li.N_LAYERS} layers, a prompt of {n_prompt} tokens, "
          f"{len(plain)} greedy tokens over the plain cache")
    print(f"{'cache':<22}{'the first token that differs':>30}{'tokens the same':>19}")
    for bits, group in ((8, 64), (8, 32), (4, 64), (4, 32)):
        if li.D_HEAD % group:  # (a head narrower than the group: none)
            continue
        cache = li.KVCache([None] * li.N_LAYERS, bits, group, 0)
        got = list(li.generate(prompt, n_new, cache=cache))
        first = next((i for i, (a, b) in enumerate(zip(plain, got)) if a != b), None)
        same = sum(a == b for a, b in zip(plain, got))
        print(f"{f'{bits} bits, groups of {group}':<22}"
              f"{'none' if first is None else first + 1:>30}{same:>12} of {len(plain)}")


def bandwidth_rows(rounds=5, size=2**28):
    """--explain's memory figure, li.bandwidth() (the best of 5 reads of size bytes already in
    memory), beside numpy copying the same bytes between two buffers already written (the best of
    5; counted once, the bytes read, as the figure counts them), interleaved, medians of rounds."""
    import numpy as np
    source, target = np.ones(size // 4, np.float32), np.zeros(size // 4, np.float32)
    ours, copies = [], []
    for _ in range(rounds):
        ours.append(li.bandwidth(size))
        best = float("inf")
        for _ in range(5):
            tic = time.perf_counter()
            np.copyto(target, source)
            best = min(best, time.perf_counter() - tic)
        copies.append(size / best)
    a, b = statistics.median(ours), statistics.median(copies)
    print(f"{mx.default_device()}, {size / 1e6:.0f} MB, medians of {rounds} rounds")
    print(f"li.bandwidth() reads {a / 1e9:.2f} GB/s; numpy copies {b / 1e9:.2f} GB/s (read, and as "
          f"much written); ratio {a / b:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Qwen3 folder; default: write random weights")
    ap.add_argument("--shape", choices=["qwen3-0.6b", "small"], default="qwen3-0.6b",
                    help="of the random checkpoint: Qwen3-0.6B's, or 28 layers of hidden 64")
    ap.add_argument("--layers", type=int, default=4, help="layers of the random checkpoint")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the random checkpoint")
    ap.add_argument("--contexts", default="512,2048,4096", help="decode after these many tokens")
    ap.add_argument("--prefills", default="256,2048", help="prompt lengths for prefill speed")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quantize", type=int, choices=[4, 8], help="quantise it with mlx_lm.convert")
    ap.add_argument("--qwen35", action="store_true", help="a random Qwen3.5 (0.8B's proportions)")
    ap.add_argument("--moe", action="store_true", help="a random Qwen3-MoE (30B-A3B's proportions)")
    ap.add_argument("--batches", help="batch sizes, e.g. 1,4,16: the batching rows only")
    ap.add_argument("--no-plain-runs", action="store_true", help="batching: skip the B plain runs")
    ap.add_argument("--draft", choices=["mtp", "lookup"], help="the drafting rows only")
    ap.add_argument("--bandwidth", action="store_true", help="--explain's figure beside numpy's copy")
    ap.add_argument("--stream", action="store_true", help="experts from disk (with --moe)")
    ap.add_argument("--reads", action="store_true", help="experts from disk: the reads alone")
    ap.add_argument("--kv-bits", type=int, choices=[4, 8], help="the KV cache in bits, from 0")
    ap.add_argument("--random-context", action="store_true", help="decode after contexts of random "
                    "keys and values, not prefilled (a 16k prefill in bits: over 40 minutes on a CPU)")
    ap.add_argument("--kv-quality", action="store_true",
                    help="with --model: where greedy answers over a cache in bits part")
    ap.add_argument("--ranks", action="store_true",
                    help="under mlx.launch -n N: ours against mlx-lm's sharded_load")
    args = ap.parse_args()
    if args.random_context and args.qwen35:
        ap.error("--random-context fills KV caches: not Qwen3.5's DeltaNet states")
    if args.kv_quality and args.model is None:
        ap.error("--kv-quality needs --model: a trained model's folder")
    if args.bandwidth:
        return bandwidth_rows()
    if args.ranks:
        shape = SMALL if args.shape == "small" else dict(
            QWEN3_06B, num_hidden_layers=args.layers,
            vocab_size=QWEN3_06B["vocab_size"] * args.layers // 28 // 64 * 64)
        return rank_rows(shape, args.dtype, args.runs)
    tmp = tempfile.TemporaryDirectory()
    folder = args.model
    if folder is None and args.shape == "small":
        shapes = SMALL
    elif folder is None:
        real = QWEN35_08B if args.qwen35 else QWEN3_30B_A3B if args.moe else QWEN3_06B
        vocab = real["vocab_size"] * args.layers // real["num_hidden_layers"] // 64 * 64
        shapes = dict(real, num_hidden_layers=args.layers, vocab_size=vocab)
    if folder is None and args.moe:
        print(f"writing a random {args.dtype} Qwen3-MoE: {shapes['num_hidden_layers']} layers of "
              f"{shapes['num_experts']} experts, vocabulary {shapes['vocab_size']} ...")
        folder = write_qwen3_moe(tmp.name, build_tokenizer(), dtype=args.dtype, lm_head="tied_stored",
                                 init="realistic", **shapes)
    elif folder is None and args.qwen35:
        print(f"writing a random {args.dtype} Qwen3.5: {shapes['num_hidden_layers']} layers, "
              f"vocabulary {shapes['vocab_size']} ...")
        folder = write_qwen35(tmp.name, build_tokenizer(), dtype=args.dtype, **shapes)
    elif folder is None:
        print(f"writing a random {args.dtype} checkpoint: {shapes['num_hidden_layers']} layers, "
              f"hidden {shapes['hidden_size']}, vocabulary {shapes['vocab_size']} ...")
        folder = write_checkpoint(tmp.name, build_tokenizer(), dtype=args.dtype, lm_head="tied_stored",
                                  init="realistic", **shapes)
    if args.draft == "mtp" and args.model is None:  # three heads on the same model
        heads = {"agreeing, layers x0": ("agree", 0.0), "agreeing, layers x1": ("agree", 1.0),
                 "random head": ("random", 1.0)}  # x0: the layers add nothing, all drafts stand
        folders = {name: write_qwen35(Path(tmp.name) / name.replace(" ", "_"), build_tokenizer(),
                                      dtype=args.dtype, mtp=mtp, layers_scale=scale, tied=False,
                                      **shapes) for name, (mtp, scale) in heads.items()}
        return draft_rows(folders, "mtp", args.runs)
    if args.draft:
        return draft_rows({"Qwen3, lookup": folder}, args.draft, args.runs)
    if args.quantize:  # mlx-lm's own tool: both implementations read the same packed weights
        from mlx_lm.convert import convert
        quantized = Path(tmp.name) / f"{args.quantize}-bit"
        convert(str(folder), str(quantized), quantize=True, q_group_size=64, q_bits=args.quantize)
        folder = quantized
    if args.stream:
        stream_rows(Path(folder), args.runs)
        return read_rows(Path(folder), args.runs)
    if args.reads:
        return read_rows(Path(folder), args.runs)
    if args.kv_quality:
        li.load_checked(folder)
        return kv_quality_rows()
    li.load(folder)
    model, _ = load_model(Path(folder))
    mx.eval(list(li.W.values()), model.parameters())
    bytes_ours = sum(w.nbytes for w in {id(w): w for w in li.W.values()}.values())
    bytes_ref = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    if args.batches:
        batch_rows(model, [int(b) for b in args.batches.split(",")], args.runs,
                   not args.no_plain_runs)
        return
    impls = {"ours": (Ours(args.kv_bits), bytes_ref), "mlx-lm": (MlxLm(model, args.kv_bits),
                                                                bytes_ours)}
    vocab = li.TOK.get_vocab_size() - 10  # ordinary tokens only
    prompt = lambda n: [(7 * i + 3) % vocab for i in range(n)]  # noqa: E731
    contexts = [int(n) for n in args.contexts.split(",") if n]
    prefills = [int(n) for n in args.prefills.split(",") if n]
    print(f"{mx.default_device()}, {li.N_LAYERS} layers, {li.W['model.norm.weight'].dtype}, "
          f"{f'{args.quantize}-bit, ' if args.quantize else ''}"
          f"runs={args.runs}, contexts={contexts}")
    print(f"kernels per layer for one decoded token: ours {kernels_per_layer(ours_step, li.N_LAYERS):.1f},"
          f" mlx-lm {kernels_per_layer(lambda: mlx_lm_step(model), li.N_LAYERS):.1f} (its mx.fast kernels"
          " are one each on a GPU; a CPU builds some from ordinary operations)")
    rows, peaks, sizes = {}, {}, {}

    def measure(label, which, run_once, name, run):
        mx.clear_cache()
        figures = timed(*run_once())
        if run:  # run 0 is the warm-up
            rows.setdefault(label, {}).setdefault(name, []).append(figures[which])

    started = time.perf_counter()
    for n in prefills:
        for run in range(args.runs + 1):
            for name, (impl, _) in impls.items():
                measure(f"prefill {n} tokens", 0, lambda: (impl.generate(prompt(n), 1), n), name, run)
    for run in range(args.runs + 1):
        for name, (impl, _) in impls.items():
            measure("decode 32 after 16", 1, lambda: (impl.generate(prompt(16), 33), 16), name, run)
    for n in contexts:
        caches = {}
        for name, (impl, other_weights) in impls.items():
            mx.clear_cache()
            mx.reset_peak_memory()
            caches[name] = impl.filled(n) if args.random_context else impl.prefill(prompt(n))
            peaks[(n, name)] = mx.get_peak_memory() - other_weights
        if args.kv_bits:
            sizes[n] = li.cache_bytes(caches["ours"], n)
        for run in range(args.runs + 1):
            for name, (impl, other_weights) in impls.items():
                mx.reset_peak_memory()
                tokens = impl.decode(caches[name], n, prompt(1)[0], 33)
                measure(f"decode 32 after {n}", 1, lambda: (tokens, 1), name, run)
                peaks[(n, name)] = max(peaks[(n, name)], mx.get_peak_memory() - other_weights)
        del caches
    print(f"{'tokens/s (median)':<24}{'ours':>10}{'mlx-lm':>10}{'ratio':>8}")
    for label, by_name in rows.items():
        a, b = (statistics.median(by_name[n]) for n in impls)
        print(f"{label:<24}{a:>10.2f}{b:>10.2f}{a / b:>7.2f}x")
    if not args.random_context:  # (random: no prefill's peak to compare)
        for n in contexts:
            a, b = (peaks[(n, name)] for name in impls)
            print(f"{f'peak memory GB, {n}':<24}{a / 1e9:>10.3f}{b / 1e9:>10.3f}{a / b:>7.2f}x")
    for n, held in sizes.items():  # the cache in bits (what quality costs: --kv-quality)
        plain = n * li.N_LAYERS * 2 * li.N_KV * li.D_HEAD * li.W["model.norm.weight"].dtype.size
        print(f"after {n} tokens, our cache in {args.kv_bits} bits: {held / 1e6:.1f} MB (in "
              f"{li.W['model.norm.weight'].dtype}: {plain / 1e6:.1f} MB, {held / plain:.0%})")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
