"""Qwen3 inference from scratch: MLX arrays and the `tokenizers` library, nothing else.

Read it top to bottom; it follows the data. Text -> token ids -> embeddings -> N transformer
blocks (RMSNorm, attention with RoPE and a KV cache, SwiGLU feed-forward) -> logits -> next token.

    python llm_inference.py                                   # "The capital of France is", greedy
    python llm_inference.py --prompt "Why is the sky blue?" --temperature 0.7 --top-p 0.8

MLX is lazy: each mx.* call below only records a graph. Work happens when a value is needed
(mx.eval, .item(), print). mx.load() maps the weight files; bytes are read when first used.
Arrays here have no batch dimension: one sequence of L tokens, shapes as in the comments
(Qwen3-0.6B's sizes: hidden 1024, 16 query heads, 8 KV heads, head_dim 128, vocab 151936).
"""
import argparse
import json
import math
import time
from pathlib import Path

import mlx.core as mx
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# ═══ 0. Load: config, weights W, tokenizer — the recipe, the ingredients, the dictionary ═══
W = {}           # Hugging Face tensor name -> array, e.g. W["model.norm.weight"] (1024,)
TOK = None       # tokenizers.Tokenizer from tokenizer.json: text <-> token ids
D = 0            # 1024   hidden_size: width of the residual stream
N_LAYERS = 0     # 28     num_hidden_layers
N_HEADS = 0      # 16     num_attention_heads (query heads)
N_KV = 0         # 8      num_key_value_heads (2 query heads share 1 KV head)
HEAD_DIM = 0     # 128    head_dim: NOT hidden/heads (64); 16 x 128 = 2048 != 1024
EPS = 0.0        # 1e-6   rms_norm_eps
THETA = 0.0      # 1e6    rope_theta: base of RoPE's rotation frequencies
MAX_POS = 0      # 40960  max_position_embeddings: the longest context
EOS_IDS = set()  # {151645 <|im_end|>, 151643 <|endoftext|>}: generation stops on any of them


def _ids(x):
    """An eos_token_id entry (int, list or missing) -> set of ints."""
    return set(x) if isinstance(x, list) else ({x} if isinstance(x, int) else set())


def expected_shapes(cfg):
    """Every tensor name the model uses -> the shape config.json predicts for it."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f)})
    return shapes


def load(model_dir):
    """Read config.json (+ generation_config.json), every *.safetensors file into W, tokenizer.json."""
    global W, TOK, D, N_LAYERS, N_HEADS, N_KV, HEAD_DIM, EPS, THETA, MAX_POS, EOS_IDS
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    gen_file = model_dir / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    D, N_LAYERS = cfg["hidden_size"], cfg["num_hidden_layers"]
    N_HEADS, N_KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    HEAD_DIM = cfg.get("head_dim") or D // N_HEADS
    EPS, MAX_POS = cfg["rms_norm_eps"], cfg["max_position_embeddings"]
    THETA = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]  # transformers 5 nests it
    EOS_IDS = _ids(cfg.get("eos_token_id")) | _ids(gen.get("eos_token_id"))
    W = {}
    for f in sorted(model_dir.glob("*.safetensors")):  # one file, or model-0000i-of-0000N shards
        W.update(mx.load(str(f)))
    if cfg.get("tie_word_embeddings") or "lm_head.weight" not in W:
        W["lm_head.weight"] = W.get("model.embed_tokens.weight")  # tied: one matrix reads and writes
    for name, shape in expected_shapes(cfg).items():
        if W.get(name) is None:
            raise ValueError(f"tensor {name} is missing from the *.safetensors files in {model_dir}")
        if tuple(W[name].shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(W[name].shape)}, expected {shape}")
    TOK = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return cfg


# ═══ 1. RMSNorm — turn the volume to a standard level, then apply a learned per-channel gain ═══
def rms_norm(x, w):
    """x: (..., n), w: (n,) -> (..., n). x / sqrt(mean(x^2) + eps) * w.
    float32 for the mean of squares: bfloat16 keeps 8 bits of mantissa and the sum drifts."""
    x32 = x.astype(mx.float32)                                                  # (..., n)
    x32 = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + EPS)     # (..., n)
    return w * x32.astype(x.dtype)                                              # (..., n)


# ═══ 2. RoPE — a clock hand per pair of dimensions, turned by the token's position ═══
def apply_rope(q, k, positions):
    """q: (H, L, hd), k: (KV, L, hd), positions: (L,) -> q, k rotated.
    "Rotate-half": dimension i pairs with i + hd/2 and turns by angle pos * THETA^(-2i/hd)."""
    half = HEAD_DIM // 2
    inv_freq = THETA ** (-mx.arange(0, half, dtype=mx.float32) * 2 / HEAD_DIM)   # (64,)
    angles = positions.astype(mx.float32)[:, None] * inv_freq[None, :]          # (L, 64) float32:
    angles = mx.concatenate([angles, angles], axis=-1)                          # (L, 128) pos*freq
    # Cast cos/sin to the activation dtype: float32 here would silently promote q, k, the
    # scores and the KV cache (and so the whole residual stream) to float32.
    cos, sin = mx.cos(angles).astype(q.dtype), mx.sin(angles).astype(q.dtype)  # (L, 128)

    def rotate(x):                                                              # (heads, L, 128)
        rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)      # (heads, L, 128)
        return x * cos + rotated * sin                                          # (heads, L, 128)

    return rotate(q), rotate(k)


# ═══ 3. Grouped-query attention — every token asks, earlier tokens answer; 2 askers share a key ═══
def attention(x, layer_idx, cache, positions):
    """x: (L, D), positions: (L,) absolute positions -> (L, D).
    cache[layer_idx] is None or (keys, values) of the earlier tokens; this call appends L more."""
    p = f"model.layers.{layer_idx}.self_attn."
    L = x.shape[0]
    q = (x @ W[p + "q_proj.weight"].T).reshape(L, N_HEADS, HEAD_DIM)   # (L, 16, 128)
    k = (x @ W[p + "k_proj.weight"].T).reshape(L, N_KV, HEAD_DIM)      # (L, 8, 128)
    v = (x @ W[p + "v_proj.weight"].T).reshape(L, N_KV, HEAD_DIM)      # (L, 8, 128)
    # QK-norm: Qwen3 RMS-normalises every 128-dim head of q and k before RoPE.
    q = rms_norm(q, W[p + "q_norm.weight"]).transpose(1, 0, 2)         # (16, L, 128)
    k = rms_norm(k, W[p + "k_norm.weight"]).transpose(1, 0, 2)         # (8, L, 128)
    v = v.transpose(1, 0, 2)                                           # (8, L, 128)
    q, k = apply_rope(q, k, positions)                                 # (16, L, 128), (8, L, 128)
    if cache[layer_idx] is not None:                                   # prepend the earlier tokens
        k = mx.concatenate([cache[layer_idx][0], k], axis=1)           # (8, S, 128), S = start + L
        v = mx.concatenate([cache[layer_idx][1], v], axis=1)           # (8, S, 128)
    cache[layer_idx] = (k, v)
    # GQA without copying K and V: view the 16 query heads as 8 groups of 2; a group shares a head.
    q = q.reshape(N_KV, N_HEADS // N_KV, L, HEAD_DIM)                  # (8, 2, L, 128)
    scores = q @ k[:, None].swapaxes(-1, -2)                           # (8, 2, L, S)
    scores = scores.astype(mx.float32) / math.sqrt(HEAD_DIM)           # (8, 2, L, S) float32 softmax
    # Causal mask, right with a cache: the query at position p may see keys at positions 0..p.
    visible = mx.arange(k.shape[1])[None, :] <= positions[:, None]     # (L, S) bool
    scores = mx.where(visible, scores, -mx.inf)                        # (8, 2, L, S)
    weights = mx.softmax(scores, axis=-1).astype(v.dtype)              # (8, 2, L, S)
    out = weights @ v[:, None]                                         # (8, 2, L, 128)
    out = out.reshape(N_HEADS, L, HEAD_DIM).transpose(1, 0, 2)         # (L, 16, 128)
    return out.reshape(L, N_HEADS * HEAD_DIM) @ W[p + "o_proj.weight"].T  # (L, 1024)


# ═══ 4. SwiGLU feed-forward — a gate decides how much of each of 3072 features passes ═══
def ffn(x, layer_idx):
    """x: (L, D) -> (L, D). down( silu(gate(x)) * up(x) )."""
    p = f"model.layers.{layer_idx}.mlp."
    gate = x @ W[p + "gate_proj.weight"].T                             # (L, 3072)
    up = x @ W[p + "up_proj.weight"].T                                 # (L, 3072)
    return (gate * mx.sigmoid(gate) * up) @ W[p + "down_proj.weight"].T  # (L, 1024)


# ═══ 5. Transformer block — normalise, attend, add; normalise, think, add ═══
def transformer_block(x, layer_idx, cache, positions):
    """x: (L, D) -> (L, D). Pre-norm with two residual connections."""
    p = f"model.layers.{layer_idx}."
    x = x + attention(rms_norm(x, W[p + "input_layernorm.weight"]), layer_idx, cache, positions)
    return x + ffn(rms_norm(x, W[p + "post_attention_layernorm.weight"]), layer_idx)  # (L, 1024)


# ═══ 6. Forward — ids in, one score per vocabulary entry out, for every position ═══
def forward(token_ids, cache, start_pos):
    """token_ids: L ints at positions start_pos.. -> logits (L, vocab).
    cache: list with one entry per layer ([None] * N_LAYERS to start); extended in place."""
    positions = mx.arange(start_pos, start_pos + len(token_ids))       # (L,)
    x = W["model.embed_tokens.weight"][mx.array(token_ids)]            # (L, 1024)
    for i in range(N_LAYERS):
        x = transformer_block(x, i, cache, positions)                  # (L, 1024)
    x = rms_norm(x, W["model.norm.weight"])                            # (L, 1024)
    return x @ W["lm_head.weight"].T                                   # (L, 151936)


# ═══ 7. Sampling — pick the next token: the favourite, or a weighted draw from the front-runners ═══
def sample(logits, temperature=0.0, top_p=1.0):
    """logits: (vocab,) -> token id as a 0-d array. temperature 0 = greedy (argmax).
    Otherwise softmax(logits / T), keep the smallest set of tokens whose probabilities
    sum to top_p (the nucleus), and draw from it. float32: bfloat16 probabilities are coarse."""
    if temperature == 0:
        return mx.argmax(logits)
    logits = logits.astype(mx.float32)                                 # (vocab,)
    logits = (logits - logits.max()) / temperature                     # (vocab,) max is 0: no overflow
    probs = mx.softmax(logits)                                         # (vocab,)
    order = mx.argsort(-probs)                                         # (vocab,) most likely first
    sorted_p = probs[order]                                            # (vocab,)
    mass_before = mx.cumsum(sorted_p) - sorted_p                       # (vocab,) mass of likelier ones
    keep = mass_before < top_p                                         # (vocab,) always keeps the top
    masked = mx.where(keep, logits[order], -mx.inf)                    # (vocab,)
    return order[mx.random.categorical(masked)]                        # () a token id


# ═══ 8. Generate — read the prompt once, then write one token at a time ═══
def generate(prompt_ids, max_tokens=100, temperature=0.0, top_p=1.0):
    """Yield up to max_tokens token ids (ints) that continue prompt_ids; stops before any EOS id."""
    cache = [None] * N_LAYERS                                          # one (keys, values) per layer
    pos = len(prompt_ids)
    logits = forward(prompt_ids, cache, 0)[-1]                         # (vocab,) prefill
    for _ in range(max_tokens):
        token = sample(logits, temperature, top_p).item()              # .item() runs the graph
        if token in EOS_IDS:
            return
        yield token
        logits = forward([token], cache, pos)[-1]                      # (vocab,) one decode step
        pos += 1


def stream_text(token_ids):
    """Yield the text each new token adds. A character split over several byte-level tokens
    (emoji, CJK) comes out whole, once its last byte arrives: no broken UTF-8 is ever printed
    (so a character left unfinished when generation stops is not printed at all)."""
    stream = DecodeStream(skip_special_tokens=False)
    for token in token_ids:
        yield stream.step(TOK, token) or ""


# ═══ 9. Command line — flags named as in mlx_lm.generate ═══
def main(argv=None):
    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description="Qwen3 text generation from scratch with MLX.")
    ap.add_argument("--model", default=str(here / "Qwen3-0.6B"), help="folder with the model files")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max-tokens", "-m", type=int, default=100)
    ap.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    if args.seed is not None:
        mx.random.seed(args.seed)
    load(args.model)
    n_params = sum(w.size for name, w in W.items() if name != "lm_head.weight" or
                   w is not W["model.embed_tokens.weight"])
    print(f"Qwen3 from {args.model}: {N_LAYERS} layers, hidden {D}, {N_HEADS} query / {N_KV} KV heads"
          f" x {HEAD_DIM}, {n_params / 1e9:.2f}B parameters, {W['model.norm.weight'].dtype}")
    prompt_ids = TOK.encode(args.prompt).ids
    print("=" * 10 + "\n" + args.prompt, end="", flush=True)
    tokens = generate(prompt_ids, args.max_tokens, args.temperature, args.top_p)
    n, start, first = 0, time.perf_counter(), None
    for n, piece in enumerate(stream_text(tokens), 1):
        first = first or time.perf_counter()  # token 1 needs the whole prompt: prompt time
        print(piece, end="", flush=True)
    end = time.perf_counter()
    prompt_s, gen_s = (first or end) - start, end - (first or end)
    print("\n" + "=" * 10)
    print(f"Prompt: {len(prompt_ids)} tokens, {len(prompt_ids) / max(prompt_s, 1e-9):.3f} tokens-per-sec")
    print(f"Generation: {n} tokens, {max(n - 1, 0) / max(gen_s, 1e-9):.3f} tokens-per-sec")
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
