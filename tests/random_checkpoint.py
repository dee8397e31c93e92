"""Write a random-weight checkpoint of Qwen3-0.6B's exact shapes in the real Hugging Face layout:
the real-weights tests (tests/test_real_weights.py) can then be proven without the real weights.
With --tiny: the tests' tiny Qwen3 instead (3 layers, hidden 64, float32, a megabyte), to try the
script without the 1.5 GB download; its text is noise (the weights are random), its code path the
real one.

    python tests/random_checkpoint.py DIR --init wide     # unit, realistic or wide (conftest.py)
    QWEN3_WEIGHTS=DIR python -m pytest tests/test_real_weights.py
    python tests/random_checkpoint.py tiny --tiny && python llm_inference.py --model tiny

Like the release: bfloat16, tied LM head with a stored copy (1.5 GB), 28 layers. The tokenizer is
the tests' own small one (its ids are the first rows of the 151,936-row embedding).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import QWEN3_06B, build_tokenizer, write_checkpoint  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--init", choices=["unit", "realistic", "wide"], default="wide")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny Qwen3, not 0.6B's shapes")
    args = ap.parse_args()
    if args.tiny:
        write_checkpoint(args.folder, build_tokenizer(), seed=args.seed)
        print(f"wrote {args.folder}: a tiny random Qwen3 (3 layers, hidden 64; its text is noise)")
        sys.exit(0)
    write_checkpoint(args.folder, build_tokenizer(), dtype=args.dtype, lm_head="tied_stored",
                     init=args.init, seed=args.seed, **QWEN3_06B)
    print(f"wrote {args.folder}: Qwen3-0.6B's shapes, init={args.init}, {args.dtype}")
