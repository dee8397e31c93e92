"""Qwen3 inference from scratch: MLX arrays and the `tokenizers` library, nothing else.

Read it top to bottom; it follows the data: text -> token ids -> embeddings -> N transformer
blocks (RMSNorm, attention with RoPE and a KV cache, SwiGLU feed-forward) -> logits -> next token.
The model is sections 0-8, up to generate(); section 9 serves it (checks, download, chat, CLI).
One sequence, no batch; shapes are Qwen3-0.6B's (S = tokens so far, L = tokens in this call).
MLX is lazy: each mx.* call only records a graph; work happens when a value is needed (mx.eval).
"""
import argparse, json, math, os, re, signal, sys, time  # noqa: E401 (standard library)
from functools import partial
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

def load(model_dir, dtype=None):
    """config.json (+ generation_config.json) -> the constants above; *.safetensors -> W; tokenizer.json
    -> TOK; each checked in section 9. dtype: compute in it (mx.float32), not the checkpoint's."""
    global W, TOK, D, N_LAYERS, N_HEADS, N_KV, HEAD_DIM, EPS, THETA, MAX_POS, EOS_IDS
    folder = Path(model_dir)
    cfg, EOS_IDS = read_configs(folder)  # the entries below, each checked; EOS ids of both files
    D, N_LAYERS, HEAD_DIM = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    N_HEADS, N_KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    EPS, THETA, MAX_POS = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["max_position_embeddings"]
    W = {}
    for f in sorted(folder.glob("*.safetensors")) or [folder / "model.safetensors"]:  # or shards
        tensors = read(f, mx.load, "a complete safetensors file")  # lazy: maps, reads on use
        W.update({name: w.astype(dtype or w.dtype) for name, w in tensors.items()})
    if cfg["tie_word_embeddings"] or "lm_head.weight" not in W:
        W["lm_head.weight"] = W.get("model.embed_tokens.weight")  # tied: one matrix reads and writes
    W = checked_shapes(W, cfg, folder)  # only the tensors the model uses, each of the right shape
    mx.eval(W)  # read every weight now, so that generation times only generation
    TOK = read_tokenizer(folder, cfg["vocab_size"])  # its ids must fit the embedding's rows
    return cfg

# ═══ 1. RMSNorm — turn the volume to a standard level, then apply a learned per-channel gain ═══
# @mx.compile: MLX traces once per input shape and fuses the element-wise steps into one kernel,
# the math as written. A trace keeps the Python values it read, so eps comes in as an argument.
@mx.compile
def rms_norm(x, w, eps):
    """x: (..., n), w: (n,) -> (..., n). x / sqrt(mean(x^2) + eps) * w.
    float32 for the mean of squares: bfloat16 keeps 8 bits of mantissa and the sum drifts."""
    x32 = x.astype(mx.float32)                                                  # (..., n)
    x32 = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)     # (..., n)
    return w * x32.astype(x.dtype)                                              # (..., n)

# ═══ 2. RoPE — a clock hand per pair of dimensions, turned by the token's position ═══
def rope_tables(positions, dtype):
    """positions: (L,) -> cos, sin: (L, HEAD_DIM), built once per forward pass for every layer.
    "Rotate-half": dimension i pairs with i + hd/2 and turns by angle pos * THETA^(-2i/hd)."""
    inv_freq = THETA ** (-mx.arange(0, HEAD_DIM // 2, dtype=mx.float32) * 2 / HEAD_DIM)  # (64,)
    angles = positions.astype(mx.float32)[:, None] * inv_freq[None, :]         # (L, 64) float32
    # In the activation dtype: float32 tables would promote q, k, the cache, the whole model.
    cos, sin = mx.cos(angles).astype(dtype), mx.sin(angles).astype(dtype)      # (L, 64)
    return mx.concatenate([cos, cos], -1), mx.concatenate([-sin, sin], -1)     # (L, 128): signs

@mx.compile
def apply_rope(x, cos, sin):
    """x: (heads, L, hd) -> rotated. Each pair (x1, x2) = (x[i], x[i + hd/2]) becomes
    (x1 cos - x2 sin, x2 cos + x1 sin): x * cos + (x2, x1) * (-sin, +sin)."""
    half = x.shape[-1] // 2
    swapped = mx.concatenate([x[..., half:], x[..., :half]], axis=-1)          # (heads, L, 128)
    return x * cos + swapped * sin                                              # (heads, L, 128)

# ═══ 3. Grouped-query attention — every token asks, earlier tokens answer; 2 askers share a key ═══
@partial(mx.compile, shapeless=True)  # one trace for all L and S: nothing here depends on them
def masked_scores(scores, visible, sqrt_hd):  # float32 for the softmax; -inf where not visible
    return mx.where(visible, scores.astype(mx.float32) / sqrt_hd, -mx.inf)     # (..., L, S)

def attend(q, k, v, visible):
    """q: (H, L, hd), k, v: (KV, S, hd), visible: (L, S) -> (H, L, hd): softmax(q k^T / sqrt(hd)) v.
    GQA without copying K and V: the H query heads as KV groups; a group shares a head."""
    H, L, hd = q.shape
    groups = q.reshape(k.shape[0], H // k.shape[0], L, hd)                     # (8, 2, L, 128)
    scores = groups @ k[:, None].swapaxes(-1, -2)                              # (8, 2, L, S)
    scores = masked_scores(scores, visible, math.sqrt(hd))                     # (8, 2, L, S) float32
    weights = mx.softmax(scores, axis=-1).astype(v.dtype)                      # (8, 2, L, S)
    return (weights @ v[:, None]).reshape(q.shape)                             # (16, L, 128)

def attention(x, layer_idx, cache, start, rope, visible):
    """x: (L, D) at positions start.. -> (L, D); rope, visible: from forward(). cache[layer_idx]:
    None, or buffers (keys, values) whose first `start` positions hold earlier tokens; L more."""
    p = f"model.layers.{layer_idx}.self_attn."
    L, end = x.shape[0], start + x.shape[0]
    q = (x @ W[p + "q_proj.weight"].T).reshape(L, N_HEADS, HEAD_DIM)   # (L, 16, 128)
    k = (x @ W[p + "k_proj.weight"].T).reshape(L, N_KV, HEAD_DIM)      # (L, 8, 128)
    v = (x @ W[p + "v_proj.weight"].T).reshape(L, N_KV, HEAD_DIM).transpose(1, 0, 2)  # (8, L, 128)
    # QK-norm: Qwen3 RMS-normalises every 128-dim head of q and k before RoPE.
    q = apply_rope(rms_norm(q, W[p + "q_norm.weight"], EPS).transpose(1, 0, 2), *rope)  # (16, L, 128)
    k = apply_rope(rms_norm(k, W[p + "k_norm.weight"], EPS).transpose(1, 0, 2), *rope)  # (8, L, 128)
    # KV cache: buffers grown 256 positions at a time, each token written in place (no copy of the rest).
    keys, values = cache[layer_idx] or (k[:, :0], v[:, :0])           # (8, room, 128)
    if keys.shape[1] < end:                                            # full: make room for more
        more = mx.zeros((N_KV, (end + 255) // 256 * 256 - keys.shape[1], HEAD_DIM), k.dtype)
        keys, values = mx.concatenate([keys, more], 1), mx.concatenate([values, more], 1)
    keys[:, start:end] = k                                             # write positions start..end-1
    values[:, start:end] = v                                           # in place: no copy
    cache[layer_idx] = (keys, values)
    out = attend(q, keys[:, :end], values[:, :end], visible)           # (16, L, 128), S = end
    return out.transpose(1, 0, 2).reshape(L, N_HEADS * HEAD_DIM) @ W[p + "o_proj.weight"].T  # (L, 1024)

# ═══ 4. SwiGLU feed-forward — a gate decides how much of each of 3072 features passes ═══
@mx.compile
def swiglu(gate, up):  # (L, 3072) each: silu(gate) * up, where silu(g) = g * sigmoid(g)
    return gate * mx.sigmoid(gate) * up

def ffn(x, layer_idx):
    """x: (L, D) -> (L, D). down( silu(gate(x)) * up(x) )."""
    p = f"model.layers.{layer_idx}.mlp."
    gate = x @ W[p + "gate_proj.weight"].T                             # (L, 3072)
    up = x @ W[p + "up_proj.weight"].T                                 # (L, 3072)
    return swiglu(gate, up) @ W[p + "down_proj.weight"].T              # (L, 1024)

# ═══ 5. Transformer block — normalise, attend, add; normalise, think, add ═══
def transformer_block(x, layer_idx, cache, start, rope, visible):
    """x: (L, D) -> (L, D). Pre-norm with two residual connections."""
    p = f"model.layers.{layer_idx}."
    x = x + attention(rms_norm(x, W[p + "input_layernorm.weight"], EPS), layer_idx, cache, start,
                      rope, visible)
    return x + ffn(rms_norm(x, W[p + "post_attention_layernorm.weight"], EPS), layer_idx)  # (L, 1024)

# ═══ 6. Forward — ids in, one score per vocabulary entry out, for every position ═══
def forward(token_ids, cache, start_pos, hidden=None):
    """token_ids: L ids (ints or an int array) at positions start_pos.. -> logits (L, vocab). cache:
    one entry per layer ([None] * N_LAYERS to start); hidden: a list for x after every block."""
    x = W["model.embed_tokens.weight"][mx.array(token_ids)]            # (L, 1024)
    end = start_pos + x.shape[0]                                       # S: positions after this call
    positions = mx.arange(start_pos, end)                              # (L,)
    rope = rope_tables(positions, x.dtype)                             # cos, sin: (L, 128) each
    visible = mx.arange(end)[None, :] <= positions[:, None]            # (L, S) causal: key <= query
    for i in range(N_LAYERS):
        x = transformer_block(x, i, cache, start_pos, rope, visible)  # (L, 1024)
        if hidden is not None:
            hidden.append(x)
    x = rms_norm(x, W["model.norm.weight"], EPS)                       # (L, 1024)
    return x @ W["lm_head.weight"].T                                   # (L, 151936)

# ═══ 7. Sampling — pick the next token: the favourite, or a weighted draw from the front-runners ═══
def sample(logits, temperature=0.0, top_p=1.0):
    """logits: (vocab,) -> token id (0-d array). temperature 0 = greedy (argmax); else softmax(logits
    / T) over the fewest tokens whose probabilities sum to top_p (the nucleus), in float32."""
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
def prefill(prompt_ids, cache, start=0, hidden=None):
    """Run the prompt in at positions start.. -> logits (vocab,) of its last token, lazy (hidden: see
    forward). The rest only fill the cache, 512 at a time: MLX computes what mx.eval asks, no logits."""
    *head, last = prompt_ids
    for i in range(0, len(head), 512):
        forward(head[i:i + 512], cache, start + i)
        mx.eval(cache)
    return forward([last], cache, start + len(head), hidden)[-1]      # (vocab,)

def generate(prompt_ids, max_tokens=100, temperature=0.0, top_p=1.0, cache=None, start=0):
    """Yield up to max_tokens ids (ints) after prompt_ids; stop before any EOS id and at the context
    limit. cache, start: an earlier call's cache, and how many of its positions to keep."""
    cache = cache if cache is not None else [None] * N_LAYERS          # one (keys, values) per layer
    token = sample(prefill(prompt_ids, cache, start), temperature, top_p)  # () lazy: nothing ran
    end = min(start + len(prompt_ids) + max_tokens, MAX_POS)           # never past the context
    for pos in range(start + len(prompt_ids), end):
        upcoming = None
        if pos + 1 < end:  # queue the next step before waiting for this token: the device
            logits = forward(token[None], cache, pos)[-1]              # computes it while Python
            upcoming = sample(logits, temperature, top_p)              # checks and prints this one
            mx.async_eval(upcoming)                                    # (async_eval returns at once)
        if (token_id := token.item()) in EOS_IDS:                      # .item() waits for the value
            return
        yield token_id
        token = upcoming

# ═══ 9. Around the model, which ends above: the files checked, the download, chat, command line ═══
HERE, REPO = Path(__file__).resolve().parent, "Qwen/Qwen3-0.6B"
FILES = "config.json generation_config.json tokenizer.json tokenizer_config.json model.safetensors"

def read(path, parse=lambda name: json.loads(Path(name).read_text()), what="valid JSON"):
    """parse(path), by default as JSON; a file missing, unreadable or broken raises one error."""
    path = Path(path)
    if path.parent.is_file():
        raise NotADirectoryError(f"{path.parent} is a file, not a folder (a model is a folder)")
    if not path.exists():
        raise FileNotFoundError(f"{path.parent} lacks {path.name}. Get the model: "
                                f"hf download {REPO} {FILES} --local-dir {path.parent}")
    try:
        open(path, "rb").close()  # a folder, or a file that this user may not read?
        return parse(str(path))
    except OSError as e:
        raise OSError(f"{path} cannot be read: {(e.strerror or str(e)).lower()}") from None
    except Exception as e:
        raise ValueError(f"{path} is not {what} ({e})") from None

COUNT = ("a whole number of 1 or more", lambda v: type(v) is int and v >= 1)
POSITIVE = ("a number more than 0", lambda v: type(v) in (int, float) and v > 0)
CONFIG = {  # every config.json entry that load() reads -> what it must be
    "model_type": ('"qwen3" (this script runs dense Qwen3 models only)', lambda v: v == "qwen3"),
    **dict.fromkeys(["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings"], COUNT),
    "head_dim": ("an even whole number (RoPE turns pairs)", lambda v: COUNT[1](v) and v % 2 == 0),
    "rms_norm_eps": POSITIVE, "rope_theta": POSITIVE,
    "tie_word_embeddings": ("true or false", lambda v: type(v) is bool),
    "eos_token_id": ("a token id, a list of them or null", lambda v: v is None or all(
        type(i) is int and i >= 0 for i in (v if isinstance(v, list) else [v])))}

def read_configs(folder):
    """-> config.json's CONFIG entries, checked, and its and generation_config.json's EOS ids."""
    path, gen_path = folder / "config.json", folder / "generation_config.json"
    cfg, gen = read(path), read(gen_path) if gen_path.exists() else {}
    for file, data in [(path, cfg), (gen_path, gen)]:
        if not isinstance(data, dict):
            raise ValueError(f"{file} must hold a JSON object {{...}}, not {json.dumps(data)[:40]}")
    nested = cfg.get("rope_parameters")  # transformers 5 writes rope_theta in there
    cfg = {"tie_word_embeddings": False, "eos_token_id": None,  # absent: as transformers reads them
           **(nested if isinstance(nested, dict) else {}), **cfg}
    for file, data, names in [(path, cfg, CONFIG), (gen_path, gen, {"eos_token_id"} & gen.keys())]:
        for name in names:
            what, ok = CONFIG[name]
            if name not in data:
                raise ValueError(f"{file} has no '{name}' entry")
            if not ok(data[name]):
                raise ValueError(f"{file}: {name} must be {what}, not {json.dumps(data[name])}")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError(f"{path}: num_attention_heads must be a multiple of num_key_value_heads")
    eos = [e if isinstance(e, list) else [e] for e in (cfg["eos_token_id"], gen.get("eos_token_id"))]
    return {name: cfg[name] for name in CONFIG}, {i for e in eos for i in e if i is not None}

def read_tokenizer(folder, vocab_size):
    """tokenizer.json, every id of which (added tokens too) is a row of the embedding table."""
    tok = read(folder / "tokenizer.json", Tokenizer.from_file, "a tokenizer that `tokenizers` reads")
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise ValueError(f"{folder / 'tokenizer.json'} has ids up to {top}, past the {vocab_size} rows"
                         f" of the embedding (vocab_size in {folder / 'config.json'}): another model's?")
    return tok

def checked_shapes(weights, cfg, folder):
    """weights, only the tensors the model uses, each of the shape config.json predicts (or an error)."""
    d, f, v, hd = D, cfg["intermediate_size"], cfg["vocab_size"], HEAD_DIM
    q, kv = N_HEADS * hd, N_KV * hd
    layer = {"input_layernorm": (d,), "post_attention_layernorm": (d,), "self_attn.q_proj": (q, d),
             "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d), "self_attn.o_proj": (d, q),
             "self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,), "mlp.gate_proj": (f, d),
             "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    shapes |= {f"model.layers.{i}.{name}.weight": shape
               for i in range(N_LAYERS) for name, shape in layer.items()}
    for name, shape in shapes.items():
        if weights.get(name) is None or weights[name].shape != shape:
            found = "is missing" if weights.get(name) is None else f"has shape {weights[name].shape}"
            raise ValueError(f"tensor {name} {found} in {folder}; expected shape {shape}")
    return {name: weights[name] for name in shapes}  # drops what is never used (a tied head's copy)

def stream_text(token_ids):
    """Yield (token id, the text it adds): a character split over tokens (emoji, CJK) comes out whole."""
    stream = DecodeStream(skip_special_tokens=False)
    for token in token_ids:
        yield token, stream.step(TOK, token) or ""

def chat_prompt(turns, system=None, think=True):
    """turns: [user, assistant, user, ...] texts, the user's last -> Qwen3's chat prompt.
    Earlier answers lose their <think>...</think> part, as Qwen3's own template drops it."""
    text = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    for i, turn in enumerate(turns):
        if i % 2 and "</think>" in turn:  # an earlier answer: keep what follows its thinking
            turn = turn.split("</think>")[-1].lstrip("\n")
        text += f"<|im_start|>{('user', 'assistant')[i % 2]}\n{turn}<|im_end|>\n"
    return text + "<|im_start|>assistant\n" + ("" if think else "<think>\n\n</think>\n\n")

def reusable(cached_ids, prompt_ids):
    """Cached positions a new prompt keeps: the ids' common prefix, leaving a prompt token to compute."""
    n = 0
    while n < min(len(cached_ids), len(prompt_ids) - 1) and cached_ids[n] == prompt_ids[n]:
        n += 1
    return n

def top_tokens(logits, k):
    """logits (vocab,) -> the k likeliest tokens [(id, text, probability)], softmax at temperature 1."""
    probs = mx.softmax(logits.astype(mx.float32))                      # (vocab,)
    top = mx.argsort(-probs)[:k].tolist()                              # (k,) likeliest first
    return [(t, TOK.decode([t], skip_special_tokens=False), probs[t].item()) for t in top]

def logit_lens(hidden):
    """hidden: x after each block, (1, D) each -> [(id, text, p)] of the likeliest next token had
    the model stopped there: through the final norm (else early blocks read as noise) and head."""
    return [top_tokens((rms_norm(x, W["model.norm.weight"], EPS) @ W["lm_head.weight"].T)[-1], 1)[0]
            for x in hidden]

def explain(prompt_ids, cache, start):
    """--explain: the pipeline's steps for this prompt (run into the cache) -> its last logits."""
    texts = [TOK.decode([t], skip_special_tokens=False) for t in prompt_ids]  # <|im_start|> too
    print("tokens:", ", ".join(f"{text!r} {t}" for text, t in zip(texts, prompt_ids)))
    print(f"embedding: {W['model.embed_tokens.weight'][mx.array(prompt_ids)].shape}")
    hidden = []
    logits = prefill(prompt_ids, cache, start, hidden)
    print("the answer forming: the likeliest next token after block i; then the model's top K")
    for i, (_, text, p) in enumerate(logit_lens(hidden), 1):
        print(f"{f'block {i}':>10} {text!r:>18} {p:<8.4f}{'█' * round(30 * p)}")
    return logits

def model_folder(model):
    """--model -> a folder; the default one while it lacks files, and a repo id, downloaded first."""
    path = Path(model).resolve()
    is_repo = not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", model)
    if not is_repo and (path != HERE / "Qwen3-0.6B" or all((path / f).exists() for f in FILES.split())):
        return path  # a local folder: never downloaded; load() names any file it lacks
    repo, files = (model, '--include "*.json" "*.safetensors"') if is_repo else (REPO, FILES)
    os.environ.setdefault("HF_HUB_VERBOSITY", "error")  # our one line says what went wrong
    from huggingface_hub import snapshot_download     # installed with tokenizers
    try:  # huggingface_hub fetches what is missing; offline, it returns the folder as it is
        return Path(snapshot_download(repo, local_dir=None if is_repo else path,
                                      allow_patterns=[*FILES.split(), "*.safetensors*"]))
    except Exception as e:
        sys.exit(f"error: could not download {repo} ({type(e).__name__}: {str(e).splitlines()[0]})."
                 f" Download it by hand: hf download {repo} {files} --local-dir"
                 f" {path.name if is_repo else path}")

def parse_args(argv):
    """The flags, named as in mlx_lm.generate; every value is checked here, before any work."""
    ap = argparse.ArgumentParser(description="Qwen3 text generation from scratch with MLX.")
    ap.add_argument("--model", default=str(HERE / "Qwen3-0.6B"), help="folder or Hugging Face repo")
    ap.add_argument("--prompt", "-p", help='default: "The capital of France is"; "-" reads stdin')
    ap.add_argument("--max-tokens", "-m", type=int, default=100)
    ap.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from this much probability")
    ap.add_argument("--seed", type=int, help="makes sampling reproducible")
    ap.add_argument("--show-probs", type=int, default=0, metavar="K", help="K likeliest next tokens")
    ap.add_argument("--explain", action="store_true", help="the steps inside (chat: each turn's)")
    ap.add_argument("--chat", action="store_true", help="chat template; no --prompt: a conversation")
    ap.add_argument("--system", help="system message, with --chat")
    ap.add_argument("--no-think", action="store_true", help="switch thinking off, with --chat")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: weights'")
    ap.error = lambda message: sys.exit(f"error: {message} (see --help)")  # one line, no usage
    args = ap.parse_args(argv)
    args.prompt = sys.stdin.buffer.read().decode() if args.prompt == "-" else args.prompt
    for wrong, message in [(args.prompt == "", "the prompt is empty"),
                           (args.max_tokens < 1, "--max-tokens must be at least 1"),
                           (not args.temperature >= 0, "--temperature must be 0 or more"),
                           (not 0 < args.top_p <= 1, "--top-p must be more than 0 and at most 1"),
                           (args.show_probs < 0, "--show-probs must be 0 or more"),
                           (args.system is not None and not args.chat, "--system needs --chat"),
                           (args.no_think and not args.chat, "--no-think needs --chat"),
                           (not 0 <= (args.seed or 0) < 2**64, "--seed must be from 0 to 2**64 - 1")]:
        if wrong:
            ap.error(message)
    return args

def run(prompt_ids, args, cache, start=0, echo=""):
    """--explain, --show-probs, the text as it comes (after echo), the stats -> the new ids, and
    how many of them are in the cache (the last one only if an EOS followed it)."""
    used = start + len(prompt_ids)
    if used >= MAX_POS:
        sys.exit(f"error: the prompt is {used} tokens; the context holds {MAX_POS}")
    if used + args.max_tokens > MAX_POS:
        print(f"[note: generation stops at the context limit, {MAX_POS} tokens]", file=sys.stderr)
    if args.explain or args.show_probs:  # one more pass over the prompt: generate() makes its own
        logits = explain(prompt_ids, cache, start) if args.explain else prefill(prompt_ids, cache, start)
        for _, text, p in top_tokens(logits, args.show_probs or 5):  # quoted: a leading " " shows
            print(f"{text!r:>29} {p:<8.4g}{'█' * round(30 * p)}")  # and a bar, 30 blocks for 1
    print("=" * 10 + "\n" + echo, end="", flush=True)
    generated, tic, first = [], time.perf_counter(), None
    tokens = generate(prompt_ids, args.max_tokens, args.temperature, args.top_p, cache, start)
    for token, piece in stream_text(tokens):
        first = first or time.perf_counter()  # the first token ends the prefill
        generated.append(token)
        print(piece, end="", flush=True)
    n, end = len(generated), time.perf_counter()
    first = first or end
    print(f"\n{'=' * 10}\nPrompt: {len(prompt_ids)} tokens, "
          f"{len(prompt_ids) / (first - tic):.3f} tokens-per-sec")
    print(f"Generation: {n} tokens, {max(n - 1, 0) / max(end - first, 1e-9):.3f} tokens-per-sec")
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    ran = n if n < args.max_tokens and used + n < MAX_POS else max(n - 1, 0)
    print(f"KV cache: {used + ran} positions, {cache_bytes(cache, used + ran) / 1e6:.3f} MB "
          f"({cache_bytes(cache) / 1e6:.3f} MB allocated)", flush=True)
    return generated, ran

def cache_bytes(cache, positions=None):  # every layer's keys and values at 0..positions-1 (or all)
    return sum(k[:, :positions].nbytes + v[:, :positions].nbytes for k, v in cache)

def main(argv=None):
    args = parse_args(argv)
    if args.seed is not None:
        mx.random.seed(args.seed)
    folder = model_folder(args.model)
    load(folder, args.dtype and getattr(mx, args.dtype))
    n_params = sum(w.size for w in {id(w): w for w in W.values()}.values())  # a tied head once
    dtype = str(W["model.norm.weight"].dtype).split(".")[-1]  # bfloat16, not mlx.core.bfloat16
    print(f"Qwen3 from {folder}: {N_LAYERS} layers, hidden {D}, {N_HEADS} query / {N_KV} KV heads"
          f" x {HEAD_DIM}, {n_params / 1e9:.2f}B parameters, {dtype}")
    if not args.chat or args.prompt is not None:  # one prompt, one completion
        text = args.prompt or "The capital of France is"
        prompt = chat_prompt([text], args.system, not args.no_think) if args.chat else text
        run(TOK.encode(prompt).ids, args, [None] * N_LAYERS, echo="" if args.chat else text)
        return
    if at_terminal := sys.stdin.isatty():  # a person types: say how to end; a prompt, as mlx_lm.chat
        print("Type a message and press Enter; an empty line or Ctrl-D ends the chat.", file=sys.stderr)
    turns, cache, cached_ids = [], [None] * N_LAYERS, []  # a conversation: one turn per line
    while True:  # until an empty line or the end of the input
        print(">> " if at_terminal else "", end="", flush=True)
        if not (line := sys.stdin.buffer.readline().decode().rstrip("\r\n")):
            return
        turns.append(line)
        prompt_ids = TOK.encode(chat_prompt(turns, args.system, not args.no_think)).ids
        reused = reusable(cached_ids, prompt_ids)
        print(f"[KV cache: {reused} tokens reused, {len(prompt_ids) - reused} new to prefill]")
        generated, ran = run(prompt_ids[reused:], args, cache, reused)
        turns.append(TOK.decode(generated))
        cached_ids = prompt_ids + generated[:ran]  # what the cache holds

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # Ctrl-C stops at once; the shell sees 130
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends it quietly, as it ends `cat`
    try:
        main()
    except UnicodeDecodeError as e:  # the only text not read through read(): standard input
        sys.exit(f"error: standard input is not UTF-8 text ({e.reason} at byte {e.start})")
    except (OSError, ValueError) as e:  # a missing or broken file, named in e
        sys.exit(f"error: {e}")
