"""Speed and memory of llm_inference.py next to mlx-lm, on the same weights, in one process.

    python tests/benchmark.py                  # full profile: exact Qwen3-0.6B shapes, random weights
    python tests/benchmark.py --profile fast   # 4 layers: a quick look
    python tests/benchmark.py --model Qwen3-0.6B

Runs alternate between the two implementations (ours, mlx-lm, ours, mlx-lm, ...) after one
warm-up each, and each figure is the median over --runs. Prefill tokens/s = prompt tokens /
time to the first token; decode tokens/s = tokens after the first / the time they took.
Peak memory is each implementation's own: MLX's peak during its runs, minus the weights of the
other implementation, which sit in memory too. Not collected by pytest (no test_ prefix).
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import llm_inference as li  # noqa: E402
from conftest import build_tokenizer, write_checkpoint  # noqa: E402

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)


def timed(tokens, n_prompt):
    """Drain a token iterator -> (prefill tokens/s, decode tokens/s, tokens)."""
    start = time.perf_counter()
    first, n = None, 0
    for n, _ in enumerate(tokens, 1):
        first = first or time.perf_counter()
    end = time.perf_counter()
    return n_prompt / (first - start), (n - 1) / (end - first), n


def ours(ids, max_tokens):
    return li.generate(ids, max_tokens=max_tokens)


def reference(model):
    def run(ids, max_tokens):
        return (int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens))
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Qwen3 folder; default: write random weights")
    ap.add_argument("--profile", choices=["fast", "full"], default="full")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the random checkpoint")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    folder = args.model
    if folder is None:
        shapes = dict(QWEN3_06B, num_hidden_layers=4 if args.profile == "fast" else 28)
        print(f"writing a random {args.dtype} checkpoint with {shapes['num_hidden_layers']} layers ...")
        folder = write_checkpoint(tmp.name, build_tokenizer(), dtype=args.dtype, lm_head="tied_stored",
                                  **shapes)
    li.load(folder)
    model, _ = load_model(Path(folder))
    mx.eval(list(li.W.values()))
    bytes_ours = sum(w.nbytes for w in {id(w): w for w in li.W.values()}.values())
    bytes_ref = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    impls = {"ours": (ours, bytes_ref), "mlx-lm": (reference(model), bytes_ours)}
    vocab = li.TOK.get_vocab_size() - 10  # ordinary tokens only
    prompt = lambda n: [(7 * i + 3) % vocab for i in range(n)]  # noqa: E731
    cases = [("prefill  16 tokens", prompt(16), 1, 0), ("prefill 256 tokens", prompt(256), 1, 0),
             ("decode 32 after 16", prompt(16), 33, 1), ("decode 32 after 512", prompt(512), 33, 1)]
    results = {(c[0], name): [] for c in cases for name in impls}
    peaks = dict.fromkeys(impls, 0)
    print(f"{mx.default_device()}, {li.N_LAYERS} layers, {li.W['model.norm.weight'].dtype}, runs={args.runs}")
    for run in range(args.runs + 1):  # run 0 is the warm-up
        for label, ids, max_tokens, which in cases:
            for name, (fn, other_weights) in impls.items():
                mx.clear_cache()
                mx.reset_peak_memory()
                figures = timed(fn(ids, max_tokens), len(ids))
                peaks[name] = max(peaks[name], mx.get_peak_memory() - other_weights)
                if run:
                    results[(label, name)].append(figures[which])
    print(f"{'tokens/s (median)':<22}{'ours':>10}{'mlx-lm':>10}{'ratio':>8}")
    for label, *_ in cases:
        a, b = (statistics.median(results[(label, n)]) for n in impls)
        print(f"{label:<22}{a:>10.2f}{b:>10.2f}{a / b:>7.2f}x")
    a, b = peaks.values()
    print(f"{'peak memory (GB)':<22}{a / 1e9:>10.3f}{b / 1e9:>10.3f}{a / b:>7.2f}x")


if __name__ == "__main__":
    main()
