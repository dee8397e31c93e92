"""Qwen3 from scratch beside "Inside an LLM: Pure Python Inference for Qwen3-0.6B on MLX".
Part I    the article's script: constants, load(), Steps 1-9 through generate(), then the
          article's run. Copied out alone (up to Part II's banner), it runs as the article's does.
Part II   what the article leaves out, the model side: quantised weights, Qwen3.5's hybrid
          attention, multi-token prediction, batching, several machines, mixtures of experts,
          long context by YaRN, and what does not fit: experts from disk, the KV cache in bits.
Part III  See inside: the views that teach (--explain), each callable from a notebook.
Part IV   the program, read top-down from main(): the command line, an answer, a batch, chat,
          loading and its checks, the download, several processes."""
import json, math, time  # noqa: E401
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
from tokenizers import Tokenizer

# ═══ Part I — the article's script. Its constants hold Qwen3-0.6B's values until load() ═══
# Names from later parts, each on a branch that plain Qwen3 (16-bit, its RoPE unscaled, one
# process, one sequence, a 16-bit cache) never takes; a copy may leave those branches out:
# load_checked (load: other models), quantized_linear and SPLIT (linear), embed_quantized
# (embed), yarn (rope_tables), qwen35_attention and attention_rows (attention), cache_write_bits
# (cache_write), attend_bits (attend), moe (ffn).
W = {}           # Hugging Face tensor name -> array, e.g. W["model.norm.weight"] (1024,)
TOK = None       # tokenizers.Tokenizer from tokenizer.json: text <-> token ids
D = 1024         # hidden_size: width of the residual stream
N_LAYERS = 28    # num_hidden_layers
N_HEADS = 16     # num_attention_heads (query heads)
N_KV = 8         # num_key_value_heads (2 query heads share 1 KV head)
D_HEAD = 128     # head_dim: not D / N_HEADS (64); 16 x 128 = 2048 != 1024
EPS = 1e-6       # rms_norm_eps
THETA = 1e6      # rope_theta: base of RoPE's rotation frequencies
MAX_POS = 40960  # max_position_embeddings: the longest context
EOS_IDS = {151645, 151643}  # <|im_end|>, <|endoftext|>: the article stops on one; any stops here
MODEL = "qwen3"  # model_type: "qwen3", or "qwen3_5" (Qwen3.5: Part II); their "_moe": MOE
QWEN35 = {}      # Qwen3.5's own config entries (Part II); {} for Qwen3
MOE = {}         # a mixture of experts' config entries (Part II); {} for a dense model
YARN = {}        # rope_scaling's, for YaRN's long context (Part II); {} for the plain RoPE
GROUP = None     # several processes (Part II): mx.distributed's group, each holds 1/N of a block
GROW = 256       # the KV cache's buffers hold a multiple of this many positions (Step 5)
CHUNK = 512      # a long prompt goes through the model this many tokens at a time (Step 9)

def use(cfg, weights, tokenizer):  # config.json's entries (and "eos_ids") -> the constants
    global W, TOK, D, N_LAYERS, N_HEADS, N_KV, D_HEAD, EPS, THETA, MAX_POS, EOS_IDS, MODEL, QWEN35
    global MOE, YARN, GROUP, POOLS
    W, TOK, EOS_IDS, QWEN35 = weights, tokenizer, cfg["eos_ids"], cfg.get("qwen35", {})
    MOE, YARN, POOLS = cfg.get("moe", {}), cfg.get("yarn", {}), cfg.get("pools", {})
    MODEL, GROUP = cfg["model_type"], cfg.get("group")  # (one process: no group)
    D, N_LAYERS, D_HEAD = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    N_HEADS, N_KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    EPS, THETA, MAX_POS = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["max_position_embeddings"]
    return cfg

def as_list(ids):  # an EOS entry: an id, a list of them, or null
    return ids if isinstance(ids, list) else [ids]

def load(model_dir, dtype=None):
    """Qwen3's config.json, weights (mx.load) and tokenizer.json, unchecked (the article shows no
    loader: this is one); dtype: compute in it, not the weights' own. Other models, and the
    command line, go through load_checked() (Part IV), which checks every file and entry first."""
    folder = Path(model_dir)
    cfg = json.loads((folder / "config.json").read_text())
    nested = cfg.get("rope_parameters", {})  # transformers 5 writes rope_theta (and scaling) here
    scaling = cfg.get("rope_scaling") or nested  # (a kind other than "default": YaRN)
    scaled = not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get(
        "type")) not in (None, "default")
    if cfg["model_type"] != "qwen3" or "quantization" in cfg or scaled:  # Qwen3.5, experts,
        return load_checked(folder, dtype)  # quantised weights, YaRN: Part IV
    cfg.setdefault("rope_theta", nested.get("rope_theta"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    gen = folder / "generation_config.json"  # Qwen3's EOS ids, where there is one
    released = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]  # Qwen3's two
    gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else released
    cfg["eos_ids"] = set(as_list(cfg.get("eos_token_id")) + as_list(gen_eos)) - {None}
    index, files = folder / "model.safetensors.index.json", ["model.safetensors"]  # 0.6B: one file
    if index.exists():  # a larger Qwen3's shards, as its index names them
        files = set(json.loads(index.read_text())["weight_map"].values())
    weights = {name: w.astype(dtype or w.dtype)
               for file in files for name, w in mx.load(str(folder / file)).items()}
    if cfg.get("tie_word_embeddings"):  # Qwen3-0.6B: one table, read both ways
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    mx.eval(weights)  # read from disk now, so that generation times only generation
    return use(cfg, weights, tok)

def linear(x, name, summed=True):
    """x @ W[name + ".weight"].T, the article's product (quantised: Part II). Several processes
    (Part II): where each holds some of its input columns, each has a part; all_sum adds them
    (summed=False: not yet, a mixture of experts adds its parts once)."""
    y = quantized_linear(x, name) if name + ".scales" in W else x @ W[name + ".weight"].T
    if GROUP is not None and summed and SPLIT.get(name.split(".")[-1]) == -1:  # o, down, out
        y = mx.distributed.all_sum(y, group=GROUP)                    # (L, out)
    return y

# ═══ Step 1. Tokenize — text becomes ids, numbers in the model's own dictionary ═══
def tokenize(text):
    """Text -> token ids: "The capital of France is" -> [785, 6722, 315, 9625, 374]."""
    return TOK.encode(text).ids

# ═══ Step 2. Embed — each id picks its row of a table: the token's meaning, before context ═══
def embed(token_ids):
    """L ids -> (L, D): row i of model.embed_tokens.weight (151936, 1024) for id i."""
    if "model.embed_tokens.scales" in W:  # a quantised table: Part II
        return embed_quantized(mx.array(token_ids))
    return W["model.embed_tokens.weight"][mx.array(token_ids)]        # (L, 1024)

# ═══ Step 3. RMSNorm — turn the volume to a standard level, then a learned gain per channel ═══
# @mx.compile, here and below: MLX traces the function once per input shape (or once, shapeless)
# and fuses its element-wise steps into one kernel. Delete it: the same numbers, more slowly.
@mx.compile
def rms_norm(x, w, eps=1e-6):
    """x: (..., n), w: (n,) -> x / sqrt(mean(x^2) + eps) * w: normalised in float32 (bfloat16's
    mean drifts), cast back, then the gain (as HF). eps: 1e-6, the article's EPS; the model's
    calls give EPS, config.json's (a default is traced once: it would not follow EPS)."""
    x32 = x.astype(mx.float32)                                        # (..., n)
    x32 = x32 * mx.rsqrt(mx.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # (..., n)
    return w * x32.astype(x.dtype)                                    # (..., n)

# ═══ Step 4. RoPE — a clock hand per pair of dimensions, turned by the token's position ═══
def rope_tables(positions, dtype, dims=None):
    """positions (L,) -> cos, signed_sin (L, 1, 2, 64) for the halves of each head: pair i turns by
    position * f_i. Once a pass (the article: per layer), in the model's dtype (float32 spreads)."""
    half = (dims or D_HEAD) // 2                                      # 64
    freqs = 1.0 / THETA ** (mx.arange(half, dtype=mx.float32) / half)  # (64,) f_i
    freqs, scale = yarn(freqs) if YARN else (freqs, 1.0)  # long context: some f_i slower, Part II
    angles = positions.astype(mx.float32)[:, None, None, None] * freqs  # (L, 1, 1, 64) float32
    cos = mx.cos(angles) if scale == 1 else scale * mx.cos(angles)    # (L, 1, 1, 64)
    cos = mx.broadcast_to(cos, (*angles.shape[:2], 2, half))          # (L, 1, 2, 64) cos, cos
    signed_sin = mx.sin(angles) * mx.array([[-scale], [scale]])       # (L, 1, 2, 64) -sin, sin
    return cos.astype(dtype), signed_sin.astype(dtype)

@mx.compile
def apply_rope(x, cos, signed_sin):
    """x: (L, heads, hd) -> each pair (x1, x2) = (x[i], x[i + hd/2]) turned by its angle, as the
    article's rotate(): [x1 cos - x2 sin, x1 sin + x2 cos], here in one fused product on x seen as
    its two halves: (x1, x2) * (cos, cos) + (x2, x1) * (-sin, sin), (x2, x1) the halves reversed
    (a view: no copy, unlike the article's concatenate). The article's apply_rope(q, k): both."""
    if not isinstance(signed_sin, mx.array) or signed_sin.ndim != 4:  # the article's call: ours
        raise TypeError("apply_rope() turns one tensor, positions first; the article's q is heads "
                        "first, (16, L, 128): apply_rope(q.swapaxes(0, 1), *rope_tables(mx.array("
                        "positions), q.dtype)).swapaxes(0, 1)")
    halves = x.reshape(*x.shape[:-1], 2, -1)                          # (L, heads, 2, 64) x1, x2
    turned = halves * cos + halves[..., ::-1, :] * signed_sin         # (L, heads, 2, 64)
    return turned.reshape(x.shape)                                    # (L, heads, 128)

# ═══ Step 5. Grouped-query attention — every token asks, earlier ones answer; 2 askers share ═══
class Pass(NamedTuple):
    """The article's positions, and what forward() computes from them once for every block."""
    start: object         # the first token's position, an int (a batch's rows: None, each its own)
    positions: mx.array   # (L,) each token's (a batch's: (B * L,))
    rope: tuple           # Step 4's cos and signed_sin at them, (L, 1, 2, 64) each (Qwen3.5: None)
    visible: mx.array     # (L, S) the keys each token sees (a batch's: (B, L, S))
    notes: dict = None    # drafting (Part II): {layer: a list given its DeltaNet notes per token}
    routes: list = None   # --explain (Part III): a list given each mixture's choices

def attention(x, layer_idx, cache, at):
    """x: (L, D) at at.positions -> (L, D): the article's attention(x, layer_idx, cache, positions)
    with at (a Pass) for positions."""
    if MODEL == "qwen3_5":  # Qwen3.5's hybrid layers: Part II
        return qwen35_attention(x, layer_idx, cache, at)
    if at.start is None:  # a batch's rows, each at its own positions: Part II
        return attention_rows(x, layer_idx, cache, at)
    p = f"model.layers.{layer_idx}.self_attn."
    q, k, v = queries_keys_values(x, p, at.rope)                      # (L, 16, 128), (L, 8, 128)
    keys, values = cache_write(cache, layer_idx, k, v, at.start)      # (8, S, 128) each
    out = attend(q, keys, values, at.visible)                         # (L, 2048) heads merged
    return linear(out, p + "o_proj")                                  # (L, 1024)

def queries_keys_values(x, p, rope):
    """x: (L, D) -> q, k, v in heads (N processes, Part II: 1/N of them in each), q and k normalised
    and turned. The article moves heads first, (16, seq, 128); here they stay second (the last axis:
    QK-norm, RoPE) until attend()."""
    q = linear(x, p + "q_proj").reshape(len(x), -1, D_HEAD)           # (L, 16, 128)
    k = linear(x, p + "k_proj").reshape(len(x), -1, D_HEAD)           # (L, 8, 128)
    v = linear(x, p + "v_proj").reshape(len(x), -1, D_HEAD)           # (L, 8, 128)
    q = rms_norm(q, W[p + "q_norm.weight"], EPS)                      # QK-norm: each head of q
    k = rms_norm(k, W[p + "k_norm.weight"], EPS)                      # QK-norm: each head of k
    q = apply_rope(q, *rope)                                          # (L, 16, 128)
    k = apply_rope(k, *rope)                                          # (L, 8, 128)
    return q, k, v

def cache_write(cache, layer_idx, k, v, start):
    """k, v (L, KV, hd) -> this layer's keys and values so far, (KV, S, hd); None: none yet. The
    article makes new K and V arrays each call (concatenate); here they go into buffers."""
    if hasattr(cache, "in_bits") and cache.in_bits(layer_idx, start):  # fewer bits: Part II
        return cache_write_bits(cache, layer_idx, k, v, start)
    end = start + k.shape[0]                                          # S: positions held after
    keys, values = cache[layer_idx] or (mx.zeros((k.shape[1], 0, k.shape[2]), k.dtype),) * 2
    if keys.shape[1] < end:                           # full: up to end, rounded up to GROW
        more = mx.zeros((k.shape[1], -(-end // GROW) * GROW - keys.shape[1], k.shape[2]), k.dtype)
        keys = mx.concatenate([keys, more], axis=1)                   # (8, S rounded up, 128)
        values = mx.concatenate([values, more], axis=1)               # (8, S rounded up, 128)
    keys[:, start:end] = k.transpose(1, 0, 2)                         # positions start..end-1
    values[:, start:end] = v.transpose(1, 0, 2)                       # (8, L, 128) written
    cache[layer_idx] = (keys, values)
    return keys[:, :end], values[:, :end]                             # (8, S, 128), S = end

def attend(q, k, v, visible):
    """q: (L, H, hd), k, v: (KV, S, hd) -> (L, H * hd): softmax(q k^T / sqrt(hd)) v per head. The
    article repeats each KV head for its 2 query heads (mx.repeat copies K and V); viewing the 16
    query heads as 8 sets of 2 pairs them the same way (query head h reads KV head h // 2)."""
    if isinstance(k, tuple):  # keys and values in bits: Part II
        return attend_bits(q, k, v, visible)
    L, H, hd = q.shape
    by_kv = q.transpose(1, 0, 2).reshape(k.shape[0], -1, L, hd)       # (8, 2, L, 128) heads first
    scores = by_kv @ k[:, None].swapaxes(-1, -2)                      # (8, 2, L, S)
    scores = masked_scores(scores, visible, math.sqrt(hd))            # (8, 2, L, S) float32
    probs = mx.softmax(scores, axis=-1).astype(v.dtype)               # (8, 2, L, S) rows sum to 1
    out = probs @ v[:, None]                                          # (8, 2, L, 128)
    return out.reshape(H, L, hd).transpose(1, 0, 2).reshape(L, -1)    # (L, 2048) heads merged

@partial(mx.compile, shapeless=True)  # one trace for every L and S
def masked_scores(scores, visible, sqrt_hd):
    """The causal mask. The article's triu(-1e9) suits its prefill, on an empty cache; a prompt
    continued on a cache (Step 9's chunks, a chat's next turn) needs it shifted by what the cache
    holds. Here a key is visible when its position is at most the query's; others get -inf."""
    return mx.where(visible, scores.astype(mx.float32) / sqrt_hd, -mx.inf)  # (..., L, S) f32

# ═══ Step 6. SwiGLU feed-forward — a gate decides how much of each of 3072 features passes ═══
@mx.compile
def swiglu(gate, up):  # (L, 3072) each -> silu(gate) * up, where silu(g) = g * sigmoid(g)
    return gate * mx.sigmoid(gate) * up

def ffn(x, layer_idx, routes=None):
    """x: (L, D) -> (L, D): down( silu(gate(x)) * up(x) ). routes: for --explain's view of a
    mixture's choices (Part III; a mixture, Part II, fills it)."""
    p = f"model.layers.{layer_idx}.mlp."
    if p + "gate.weight" in W:  # a router: this block's MLP is a mixture of experts (Part II)
        return moe(x, layer_idx, routes)
    gate = linear(x, p + "gate_proj")                                 # (L, 3072)
    up = linear(x, p + "up_proj")                                     # (L, 3072)
    return linear(swiglu(gate, up), p + "down_proj")                  # (L, 1024)

# ═══ Step 7. The transformer block — normalise, attend, add; normalise, think, add ═══
def transformer_block(x, layer_idx, cache, at):
    """x: (L, D) at the positions of at, a Pass -> (L, D). Pre-norm, a residual around each half."""
    p = f"model.layers.{layer_idx}."
    h = rms_norm(x, W[p + "input_layernorm.weight"], EPS)             # (L, 1024)
    out = attention(h, layer_idx, cache, at)                          # (L, 1024)
    x, h = add_rms_norm(x, out, W[p + "post_attention_layernorm.weight"], EPS)  # x + out, h
    x = x + ffn(h, layer_idx, at.routes)                              # (L, 1024)
    return x

@mx.compile
def add_rms_norm(x, out, w, eps):  # x + out, and its RMSNorm: one trace, the add fused in
    x = x + out
    return x, rms_norm(x, w, eps)

# ═══ Step 8. LM head and sampling — a score for every token, then pick the next one ═══
def lm_head(x):
    """x: (L, D) -> logits (L, vocab): the final RMSNorm, then a score per row of lm_head.weight."""
    x = rms_norm(x, W["model.norm.weight"], EPS)                      # (L, 1024)
    return linear(x, "lm_head")                                       # (L, 151936) (0.6B: tied)

def forward(token_ids, cache, start, blocks=None, notes=None, routes=None):
    """L ids at positions start.. -> logits (L, vocab): Steps 2-8. cache: one tuple per layer;
    blocks: a list, given x after each block; notes, routes: Pass's, what Part II records."""
    x = embed(token_ids)                                              # (L, 1024)
    end = start + x.shape[0]                                          # S: positions after this call
    positions = mx.arange(start, end)                                 # (L,)
    visible = mx.arange(end)[None, :] <= positions[:, None]           # (L, S) key <= query
    at = Pass(start, positions, rope_tables(positions, x.dtype), visible, notes, routes)
    for i in range(N_LAYERS):
        x = transformer_block(x, i, cache, at)                        # (L, 1024)
        if blocks is not None:
            blocks.append(x)
    return lm_head(x)                                                 # (L, 151936)

def sample(logits, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0):
    """logits (..., vocab) -> the next id of each row (...): temperature 0, the likeliest; else a
    draw from softmax(logits / T) in float32, each row its own, among the fewest likeliest tokens
    reaching top_p (the article's 0.95; at 1.0, mlx-lm's default, no cut), at most top_k (0: no
    limit), none under min_p x the likeliest's probability. The article slices and returns an int;
    this masks, and returns a lazy array so that generate() can queue the next step (Step 9)."""
    if temperature == 0:
        return mx.argmax(logits, axis=-1)                             # (...)
    logits = logits.astype(mx.float32) / temperature                  # (..., vocab) T first
    probs = mx.softmax(logits, axis=-1)                               # (..., vocab)
    order = mx.argsort(-probs, axis=-1)                               # (..., vocab) likeliest first
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)          # (..., vocab)
    mass_before = mx.cumsum(sorted_probs, axis=-1, inclusive=False)   # (..., vocab) likelier ones
    keep = (mass_before < top_p) | (top_p >= 1)  # (..., vocab) 1: all (float32 sums near 1 early)
    keep = keep & (mx.arange(keep.shape[-1]) < (top_k or keep.shape[-1]))  # the top_k likeliest
    keep = keep & (sorted_probs >= min_p * sorted_probs[..., :1])     # none far below the top one
    masked = mx.where(keep, mx.take_along_axis(logits, order, axis=-1), -mx.inf)  # (..., vocab)
    picked = mx.random.categorical(masked, axis=-1)                   # (...) a place in order
    return mx.take_along_axis(order, picked[..., None], axis=-1)[..., 0]  # (...) its id

# ═══ Step 9. Generate — read the prompt once, then write one token at a time ═══
def prefill(prompt_ids, cache, start=0, blocks=None, chunk=CHUNK):
    """Run the prompt into the cache at positions start.. -> its last token's logits (vocab,). The
    article computes every token's logits; here the others only fill the cache, chunk at a time."""
    *earlier, last_id = prompt_ids
    for i in range(0, len(earlier), chunk):
        forward(earlier[i:i + chunk], cache, start + i)
        mx.eval(cache)
    return forward([last_id], cache, start + len(earlier), blocks)[-1]  # (vocab,)

def not_finite(which, dtype):  # the weights finite (load_checked() checks them): they overflowed
    name = str(dtype).split(".")[-1]  # float16, not mlx.core.float16
    advice = "" if dtype == mx.float32 else "; compute in float32"   # (float32's: no wider here)
    return FloatingPointError(f"the logits {which} are not finite (NaN or inf) in {name}: the "
                              f"activations overflow it{advice}")

def generate(prompt_ids, max_tokens=100, sampler=sample, cache=None, start=0, logits=None):
    """The article's loop: the prefill, here at the call, then decode_tokens() -> an iterator of up
    to max_tokens ids after prompt_ids, stopping before any EOS id and at the context's end.
    sampler: sample (greedy), or partial(sample, temperature=...); cache, start: a cache and how
    much of it to keep; logits: the prompt's, if prefill() ran it in. Then the cache holds the
    prompt and every id yielded."""
    if isinstance(prompt_ids, str):  # the article's generate() takes text and returns text
        raise TypeError("generate() takes ids: text + TOK.decode(list(generate(tokenize(text))))")
    cache = [None] * N_LAYERS if cache is None else cache
    if logits is None:
        logits = prefill(prompt_ids, cache, start)                    # (vocab,) lazy
    first = start + len(prompt_ids)                                   # the first id's position
    return decode_tokens(logits, cache, first, min(first + max_tokens, MAX_POS), sampler)

def decode_tokens(logits, cache, first, end, sampler):
    """Yield the ids at positions first..end-1, each sampled from the logits before it (the
    first's: given), stopping before an EOS id."""
    # The article's loop, as MLX runs it: an mx.* call only records; MLX computes when Python needs
    # a value (.item()) or when asked (mx.async_eval starts the work and returns at once). The step
    # that feeds token n back is queued before n is looked at, so MLX computes n + 1 while Python
    # checks and yields n (the first token queued alone, as mlx-lm does). An EOS is seen after its
    # step was recorded: the cache is set back to its tuples before that step.
    token, finite = sampler(logits), mx.isfinite(logits).all()       # () ()
    mx.async_eval(token, finite)
    for pos in range(first, end):
        before = list(cache)
        logits = forward(token[None], cache, pos)[-1]                 # (vocab,)
        upcoming = sampler(logits), mx.isfinite(logits).all()
        if pos + 1 < end:
            mx.async_eval(upcoming)
        if not finite.item():  # NaN or inf: the numbers overflowed the dtype
            raise not_finite(f"for token {pos - first + 1}", logits.dtype)
        if token.item() in EOS_IDS:
            cache[:] = before
            return
        yield token.item()
        token, finite = upcoming

# ═══ The article's run — Part I alone, run as a script, prints what the article's prints ═══
def article(folder="Qwen3-0.6B", prompt="The capital of France is"):
    """The article's script's run: its folder found from where it is started, as the article's
    is; the time is the answer's (tokenize, generate, TOK.decode), after the load."""
    load(folder)
    print(f"Model: {Path(folder).name} ({N_LAYERS} layers, {D} dim, {N_HEADS} Q heads, "
          f"{N_KV} KV heads)")
    print(f"Prompt: {prompt}\n{'-' * 60}")
    tic = time.perf_counter()
    ids = tokenize(prompt)
    print(f"Output: {TOK.decode(ids + list(generate(ids)))}")
    print(f"Time: {time.perf_counter() - tic:.2f}s")

# A file run as a script: Part I copied out alone runs the article's; the whole file, main() at
# its end (Part IV). A notebook's cell (no __file__) only defines.
if __name__ == "__main__" and "__file__" in globals() and "\ndef main(" not in Path(
        __file__).read_text(encoding="utf-8"):
    article()

# ═══ Part II — what the article leaves out, model side: quantised weights to a KV cache in bits ═══
# ═══ Quantised weights — numbers in 2-6 or 8 bits, a scale and a bias for each group of them ═══
def dequantize(packed, scales, biases, bits):
    """MLX's affine quantisation undone: a row of packed (uint32) is a little-endian stream of
    bits-bit integers q, and each group of them shares a scale and a bias: w = scale * q + bias,
    in float32, then the scales' dtype, as MLX's GPU kernels (its CPU's: one rounding apart)."""
    n = packed.shape[-1] * 32 // bits                                 # values in a row
    stream = mx.pad(packed.view(mx.uint8), [(0, 0)] * (packed.ndim - 1) + [(0, 1)])  # bytes, a 0
    stream = stream.astype(mx.uint32)                                 # (..., n * bits / 8 + 1)
    first_bit = mx.arange(n) * bits                                   # (n,) where q_i's bits start
    pair = stream[..., first_bit // 8] | stream[..., first_bit // 8 + 1] << 8  # (..., n) 2 bytes
    ints = (pair >> (first_bit % 8)) & (2 ** bits - 1)                # (..., n) q_i
    ints = ints.reshape(*ints.shape[:-1], scales.shape[-1], -1)       # (..., n_groups, group_size)
    w = scales[..., None] * ints.astype(mx.float32) + biases[..., None]  # (..., n_groups, size) f32
    return w.astype(scales.dtype).reshape(*w.shape[:-2], n)           # (..., n)

def quantized_linear(x, name):  # x @ dequantize(W[name]).T, never writing the unpacked matrix
    packed, scales, biases = (W[name + part] for part in (".weight", ".scales", ".biases"))
    bits, group_size = packed.shape[-1] * 32 // x.shape[-1], x.shape[-1] // scales.shape[-1]
    return mx.quantized_matmul(x, packed, scales, biases, group_size=group_size, bits=bits)

def embed_quantized(ids):  # a quantised embedding: only the rows the ids pick are unpacked
    picked = [W["model.embed_tokens" + part][ids] for part in (".weight", ".scales", ".biases")]
    return dequantize(*picked, picked[0].shape[-1] * 32 // D)         # (L, 1024)

# ═══ Qwen3.5 — hybrid attention: 3 layers in 4 keep compressed notes, the 4th its full memory ═══
def deltanet(layer_idx):  # one of Qwen3.5's Gated DeltaNet layers? (layer N, the MTP head's: no)
    types = QWEN35.get("layer_types", [])                             # one a layer; Qwen3: none
    return layer_idx < len(types) and types[layer_idx] == "linear_attention"

def qwen35_attention(x, layer_idx, cache, at):
    """Step 5's attention() for Qwen3.5 (a batch's rows too, at.start None): x (L, D) -> (L, D).
    at.rope is not read: a quarter of each head is turned, by tables of its own."""
    if deltanet(layer_idx):                                           # 18 of 24
        if at.start is None:  # a batch's rows, each its own notes
            B, L, _ = at.visible.shape
            return gated_delta_net(x.reshape(B, L, -1), layer_idx, cache).reshape(B * L, -1)
        return gated_delta_net(x, layer_idx, cache, at.notes)         # (L, 1024)
    q, k, v, gate = gated_queries(x, layer_idx, at.positions)         # (L, 8, 256), (L, 2, 256)
    if at.start is None:  # a batch's rows
        out = attend_rows(cache, layer_idx, q, k, v, at.positions, at.visible)  # (B * L, 2048)
    else:
        keys, values = cache_write(cache, layer_idx, k, v, at.start)  # (2, S, 256) each
        out = attend(q, keys, values, at.visible)                     # (L, 2048) every 4th
    return linear(out * mx.sigmoid(gate), f"model.layers.{layer_idx}.self_attn.o_proj")

def gated_queries(x, layer_idx, positions):
    """Step 5's projections, two things changed: q_proj also gives each head a gate (applied
    to its output), RoPE turns only the first quarter of each head (its own tables, not rope's).
    x: (L, D) at positions (L,) -> q (L, 8, 256), k and v (L, 2, 256), the gate (L, 2048)."""
    p, L = f"model.layers.{layer_idx}.self_attn.", x.shape[0]
    r = int(D_HEAD * QWEN35["partial_rotary_factor"])                 # 64 of 256 dimensions
    q = linear(x, p + "q_proj").reshape(L, -1, 2 * D_HEAD)            # (L, 8, 512) q, then gate
    q, gate = q[..., :D_HEAD], q[..., D_HEAD:]                        # (L, 8, 256) each
    k = linear(x, p + "k_proj").reshape(L, -1, D_HEAD)                # (L, 2, 256)
    v = linear(x, p + "v_proj").reshape(L, -1, D_HEAD)                # (L, 2, 256)
    q = rms_norm(q, W[p + "q_norm.weight"], EPS)                      # QK-norm, as in Step 5
    k = rms_norm(k, W[p + "k_norm.weight"], EPS)                      # (L, 2, 256) QK-norm
    rope = rope_tables(positions, x.dtype, r)                         # (L, 1, 2, 32) each
    q = mx.concatenate([apply_rope(q[..., :r], *rope), q[..., r:]], axis=-1)  # (L, 8, 256)
    k = mx.concatenate([apply_rope(k[..., :r], *rope), k[..., r:]], axis=-1)  # (L, 2, 256)
    return q, k, v, gate.reshape(L, -1)

def l2_norm(x, eps=1e-6):  # x (..., n) -> x / |x| along the last axis, length 1; in float32
    x32 = x.astype(mx.float32)                                        # (..., n) float32
    return x32 * mx.rsqrt(mx.sum(x32 * x32, axis=-1, keepdims=True) + eps)

def gated_delta_net(x, layer_idx, cache, notes=None):
    """x: (L, D) (a batch's: (B, L, D)) -> the same: the article's "compressed notes". In place of
    keys and values that grow with every token, each value head keeps one fixed-size matrix, its
    state S (dk, dv), storing values under keys. Each token: forget a little (S *= decay), recall
    what S holds for its key (k S), move that towards its value (S += k^T beta (v - k S)), read.
    notes: delta_memory()'s."""
    p, lead = f"model.layers.{layer_idx}.linear_attn.", x.shape[:-1]  # (L,), or (B, L)
    hv, dv = len(W[p + "A_log"]), QWEN35["linear_value_head_dim"]     # 16 (N processes: 16 / N)
    qkv = linear(x, p + "in_proj_qkv")                                # (L, 6144) q, k, v
    z = linear(x, p + "in_proj_z").reshape(*lead, hv, dv)             # (L, 16, 128) output gate
    beta = mx.sigmoid(linear(x, p + "in_proj_b"))                     # (L, 16) write strength 0..1
    a = linear(x, p + "in_proj_a") + W[p + "dt_bias"]                 # (L, 16)
    dt = mx.logaddexp(a, 0)                                           # softplus: log(1 + e^a) > 0
    # decay: how much of S each token keeps, in 0..1 per head; a larger dt forgets more, at a
    # rate A = exp(A_log) that each head learned.
    decay = mx.exp(-mx.exp(W[p + "A_log"]) * dt)                      # (L, 16)
    y = delta_memory(cache, layer_idx, qkv, beta, decay, notes)       # (L, 16, 128) float32
    y = rms_norm(y.astype(x.dtype), W[p + "norm.weight"], EPS)        # (L, 16, 128)
    gate = z.astype(mx.float32)                                       # (L, 16, 128) output gate
    y = y.astype(mx.float32) * (gate * mx.sigmoid(gate))              # (L, 16, 128) y * silu(z)
    return linear(y.astype(x.dtype).reshape(*lead, -1), p + "out_proj")  # (L, 1024)

def delta_memory(cache, layer_idx, qkv, beta, decay, notes=None):
    """A sequence's L tokens (a batch's: (B, ...) in front) through the short convolution and the
    delta rule, from and into cache[layer_idx] = (conv_state, state) (None: none yet) -> what
    each reads, (L, 16, 128) f32. notes: a dict, given {layer_idx: the notes after each token}."""
    p, L, batch = f"model.layers.{layer_idx}.linear_attn.", qkv.shape[-2], qkv.shape[:-2]  # (B,)
    hv = len(W[p + "A_log"])                                          # 16 (N processes: 16 / N)
    hk = hv * QWEN35["linear_num_key_heads"] // QWEN35["linear_num_value_heads"]     # 16
    dk, dv = QWEN35["linear_key_head_dim"], QWEN35["linear_value_head_dim"]          # 128, 128
    width = QWEN35["linear_conv_kernel_dim"]                          # the convolution's: 4
    if cache[layer_idx] is None:                                      # nothing remembered yet
        cache[layer_idx] = (mx.zeros((*batch, width - 1, qkv.shape[-1]), qkv.dtype),
                            mx.zeros((*batch, hv, dk, dv)))            # float32, as mx.zeros makes
    conv_state, state = cache[layer_idx]                              # (3, 6144), (16, 128, 128)
    after_each = None if notes is None else notes.setdefault(layer_idx, [])
    # A short convolution first: each of the 6144 channels becomes a weighted sum of its value at
    # this token and at the 3 before it (4 learned weights a channel), so that q, k and v carry
    # a little of the tokens before. conv_state keeps the last 3 tokens' inputs for the next call.
    window = mx.concatenate([conv_state, qkv], axis=-2)               # (3 + L, 6144)
    conv = W[p + "conv1d.weight"]                                     # (6144, 4) a filter each
    qkv = sum(window[..., j:j + L, :] * conv[:, j] for j in range(width))  # (L, 6144)
    qkv = qkv * mx.sigmoid(qkv)                                       # (L, 6144) SiLU
    q, k, v = mx.split(qkv, [hk * dk, 2 * hk * dk], axis=-1)          # (L, 2048) each
    q = l2_norm(q.reshape(*batch, L, hk, dk)) / math.sqrt(dk)          # (L, 16, 128) |q| = dk^-1/2
    k = l2_norm(k.reshape(*batch, L, hk, dk))                          # (L, 16, 128) |k| = 1
    # Value head h reads key head h // (hv / hk): each key head repeated for its value heads.
    q = mx.repeat(q, hv // hk, axis=-2)                               # (L, 16, 128)
    k = mx.repeat(k, hv // hk, axis=-2)                               # (L, 16, 128)
    v, out = v.reshape(*batch, L, hv, dv), []                          # (L, 16, 128)
    for t in range(L):                                                # token after token
        state, y = delta_step(state, q[..., t, :, :], k[..., t, :, :], v[..., t, :, :],
                              decay[..., t, :], beta[..., t, :])      # y: (16, 128)
        out.append(y)
        if after_each is not None:  # drafting: the notes as they are after this token
            after_each.append((window[..., t + 1:t + width, :], state))
    cache[layer_idx] = (window[..., -(width - 1):, :], state)          # the last 3 inputs, S
    return mx.stack(out, axis=-3)                                     # (L, 16, 128)

@mx.compile
def delta_step(state, q, k, v, decay, beta):
    """The delta rule for one token, each head: state (H, dk, dv); q, k (H, dk), v (H, dv),
    decay, beta (H,) (the batch's: (B, ...) in front) -> the new state, and what q reads of it."""
    state = state * decay[..., None, None]                            # forget a little
    recalled = (k[..., None, :] @ state)[..., 0, :]                   # (H, dv) k S
    state = state + k[..., :, None] * (beta[..., None] * (v - recalled))[..., None, :]  # towards v
    return state, (q[..., None, :] @ state)[..., 0, :]                # (H, dv) q S

# ═══ Multi-token prediction — a quick guess at the next tokens, checked in one pass ═══
# Decoding waits on memory: a pass over 2 tokens costs about what one over 1 does. So guess the
# tokens after the next cheaply (drafts: Qwen3.5's MTP head's one, or the text so far) and let the
# model check them in one pass over [next, drafts]: each draft it also chooses, in turn, stands.
# Every token emitted is the model's own choice (mlx-lm's rule): greedy, generate()'s (bit for bit
# in float32); sampled, its distribution. The article's "a little quality" is not lost here.
def mtp_logits(tokens, hidden, mtp_cache, start, oldest=0):
    """Qwen3.5's MTP head: ids x_{t+1} (L,) and the model's last hidden states h_t (L, D), after
    its final norm, at positions start.. -> logits (L, vocab) for x_{t+2}. Its layer is one of
    Qwen3.5's full-attention layers (read as layer N_LAYERS) with its own KV cache; its LM head
    is the model's. oldest: the first position its cache holds (a continued cache starts later)."""
    e = rms_norm(embed(tokens), W["mtp.pre_fc_norm_embedding.weight"], EPS)  # (L, 1024)
    h = rms_norm(hidden, W["mtp.pre_fc_norm_hidden.weight"], EPS)     # (L, 1024)
    x = linear(mx.concatenate([e, h], axis=-1), "mtp.fc")             # (L, 1024) from (L, 2048)
    positions = mx.arange(start, start + x.shape[0])                  # (L,) h_t's: the draft's t
    keys = mx.arange(start + x.shape[0])[None, :]                    # (1, S)
    visible = (keys <= positions[:, None]) & (keys >= oldest)         # (L, S)
    x = transformer_block(x, N_LAYERS, mtp_cache, Pass(start, positions, None, visible))
    return linear(rms_norm(x, W["mtp.norm.weight"], EPS), "lm_head")  # (L, vocab)

def hidden_pass(token_ids, cache, start, last_x=None, chunk=CHUNK):
    """Steps 2-7 for the ids at positions start.., chunk at a time -> the last block's output
    after the final norm (L, D), what the MTP head reads; the LM head is left to the caller.
    last_x: a list, given the last token's x after each block (what --explain looks at)."""
    chunks = []
    for i in range(0, len(token_ids), chunk):
        blocks = []
        forward(token_ids[i:i + chunk], cache, start + i, blocks)  # its logits are never computed
        chunks.append(rms_norm(blocks[-1], W["model.norm.weight"], EPS))  # (chunk, 1024)
        mx.eval(chunks[-1], cache)
    if last_x is not None:
        last_x.extend(x[-1:] for x in blocks)
    return mx.concatenate(chunks)                                     # (L, 1024)

# A drafter guesses what follows: draft(history, token, hidden), history the ids so far (from
# generate_draft()'s start), token the model's next, hidden the model's hidden states it has not
# been given yet -> ids (K,), lazy. A new one for each generate_draft(): the MTP head keeps a cache.
class PromptLookup:
    """Drafts from the text so far: the last n ids (n = longest, then fewer) found earlier in it
    -> up to n_draft ids that followed their latest earlier match (none if none)."""
    def __init__(self, n_draft=3, longest=3):
        self.n_draft, self.longest = n_draft, longest

    def draft(self, history, token, hidden):  # (hidden: the MTP head's, not read here)
        ids = history + [token]
        for n in range(self.longest, 0, -1):
            for i in range(len(ids) - n - 1, -1, -1):
                if ids[i:i + n] == ids[-n:]:
                    return mx.array(ids[i + n:i + n + self.n_draft], mx.uint32)
        return mx.array([], mx.uint32)                                # (0,) none

class MTPDrafter:
    """Qwen3.5's MTP head as a drafter, with its own KV cache from position start. It reads
    (x_t+1, h_t), so each h_t waits for the id after it. A worked example: the prompt fills
    positions 0..4 and the model chose x5; the first draft() reads (x1, h0) .. (x5, h4), chunk at
    a time, and guesses d6. If the model then keeps d6, it has made h5, h6; else h5 alone: the
    next draft() reads them with the ids after position 4. like: the model's cache; the head's
    own is in bits when that is (a KVCache, Part II), with its bits, group size and
    quantized_start."""
    def __init__(self, start=0, chunk=CHUNK, like=None):
        self.cache, self.start, self.chunk = [None] * (N_LAYERS + 1), start, chunk
        if isinstance(like, KVCache):
            self.cache = KVCache(self.cache, like.bits, like.group_size, like.quantized_start)
        self.read = 0  # the positions whose h_t the head has read, from start

    def draft(self, history, token, hidden):  # hidden: h_t of each unread t -> (1,), lazy
        ids = history[self.read + 1:] + [token]                       # x_t+1 of each unread h_t
        for i in range(0, len(ids), self.chunk):
            if i:  # (a long prompt's: one chunk's cache at a time)
                mx.eval(self.cache)
            logits = mtp_logits(mx.array(ids[i:i + self.chunk]), hidden[i:i + self.chunk],
                                self.cache, self.start + self.read + i, self.start)
        self.read += len(ids)
        return mx.argmax(logits[-1:], axis=-1)                        # (1,) its guess after token

def verify_pass(ids, cache, pos, sampler):
    """Verify: the model over ids (the next id, K drafts) at pos.., one pass -> its logits, choice
    and hidden state (what the MTP head reads) after each, and each DeltaNet's notes after each id
    (notes: {layer: [its notes after ids[0], ...]}, filled by delta_memory())."""
    blocks, notes = [], {}
    logits = forward(ids, cache, pos, blocks, notes)                  # (1 + K, vocab)
    hidden = rms_norm(blocks[-1], W["model.norm.weight"], EPS)        # (1 + K, 1024)
    return logits, sampler(logits), hidden, notes

def generate_draft(prompt_ids, max_tokens=100, sampler=sample, drafter=None, cache=None, start=0,
                   hidden=None, counts=None):
    """generate(), each step in three: draft (drafter's guesses: an MTPDrafter(start), by default
    PromptLookup()), verify (one pass), accept (the drafts the model agrees with, the DeltaNet
    rolled back to there). hidden: hidden_pass()'s, if it ran the prompt in; counts: a dict, given
    "drafted", "accepted", "passes" (the model's) anew; the drafter sees this call's ids only."""
    cache = [None] * N_LAYERS if cache is None else cache
    drafter = PromptLookup() if drafter is None else drafter
    counts = {} if counts is None else counts
    counts.update(drafted=0, accepted=0, passes=0)
    hidden = hidden_pass(prompt_ids, cache, start) if hidden is None else hidden  # (L, 1024)
    logits = linear(hidden[-1:], "lm_head")[-1]                       # (vocab,) the next id's
    history, pos = list(prompt_ids), start + len(prompt_ids)  # pos: the position of token
    end = min(pos + max_tokens, MAX_POS)
    token, finite = sampler(logits).item(), mx.isfinite(logits).all().item()
    while pos < end:  # token: the model's id at pos, not in the cache yet
        if not finite:
            raise not_finite(f"at position {pos}", logits.dtype)
        if token in EOS_IDS:
            return
        counts["passes"] += 1
        if pos + 1 >= end:  # the last: into the cache first, as generate() leaves it
            forward([token], cache, pos)
            yield token
            return
        # Draft: ids guessed to follow token, lazy, never past the end.
        guessed = drafter.draft(history, token, hidden)[:end - pos - 1]  # (K,)
        # Verify: the model over token and the drafts, in one pass.
        ids = mx.concatenate([mx.array([token], mx.uint32), guessed])  # (1 + K,)
        logits, chose, hidden, notes = verify_pass(ids, cache, pos, sampler)  # chose: (1 + K,)
        rows_finite = mx.isfinite(logits).all(axis=-1).tolist()       # (1 + K,) each row's
        drafts, choices = guessed.tolist(), chose.tolist()            # ids, as lists
        # Accept: the drafts the model chose too, up to the first it did not (or an EOS). Each
        # id is yielded with the cache as generate() leaves it, wherever the caller stops: each
        # DeltaNet at its notes after that id, a KV cache's later positions written over before
        # anything reads them.
        n = 0
        while n < len(drafts) and choices[n] == drafts[n] and drafts[n] not in EOS_IDS:
            n += 1
        counts["drafted"] += len(drafts)
        counts["accepted"] += n
        history += [token] + drafts[:n]
        hidden = hidden[:n + 1]                                       # (1 + n, 1024) h_pos..
        for j, emitted in enumerate([token] + drafts[:n]):  # drafts[j - 1]: row j - 1's choice
            if j and not rows_finite[j - 1]:
                raise not_finite(f"at position {pos + j}", logits.dtype)
            for i, after_each in notes.items():
                cache[i] = after_each[j]
            yield emitted
        pos, token, logits, finite = pos + n + 1, choices[n], logits[n], rows_finite[n]

# ═══ Batching — several sequences share every weight read; a finished one makes room ═══
# Decoding one token reads every weight for one row: the machine waits on memory; B rows cost
# little more. So B sequences decode together in one cache per layer, the article's tuple with a
# slot axis in front: (B, 8, S, 128) (a DeltaNet's notes: (B, 3, 6144), (B, 16, 128, 128)). Each
# row writes at its own position and sees its own keys (its mask). A sequence that ends frees its
# slot for the next prompt, and positions no row still reaches are let go: a batch holds B
# sequences' memory, at the longest running one's length, however many prompts wait.

class Row:
    """Prompt i of a batch: token, its id at pos (lazy; at first its prompt's last id, which the
    next pass reads and nothing yields), and finite, the check of the logits it came from."""
    def __init__(self, i, ids, max_tokens):
        self.i, self.ids = i, ids
        self.end = min(len(ids) + max_tokens, MAX_POS)                # it stops before this
        self.pos, self.token, self.finite = len(ids) - 1, mx.array(ids[-1]), mx.array(True)

def padded(a, axis, size):  # a, with zeros after it along axis up to size (if shorter)
    more = list(a.shape)
    more[axis] = size - a.shape[axis]
    return a if more[axis] <= 0 else mx.concatenate([a, mx.zeros(more, a.dtype)], axis=axis)

def take_slots(cache, numbers, own):
    """own: prefill_rows()' cache, a row for each slot number -> those slots of the batch's cache
    (new ones at its end), a KV cache's positions (axis 2) padded to the longer (a DeltaNet's
    notes: the same size at any length); own's empty layer: zeros."""
    index = mx.array(numbers)                                         # (G,)
    for i, entry in enumerate(own):
        if cache[i] is None and entry is None:  # nothing in this layer yet: made on first write
            continue
        if isinstance(cache[i], Quantized) or isinstance(entry, Quantized):  # one in bits: both
            cache[i], entry = (None if e is None else to_bits(e, cache) for e in (cache[i], entry))
        if cache[i] is None:
            cache[i] = kv_entry([mx.zeros((0, *a.shape[1:]), a.dtype) for a in kv_arrays(entry)])
        arrays = [padded(a, 0, max(numbers) + 1) for a in kv_arrays(cache[i])]  # slots added
        for j, a in enumerate(arrays):
            given = mx.zeros_like(a[index]) if entry is None else kv_arrays(entry)[j]  # (G, ..)
            arrays[j] = a = padded(a, 2, given.shape[2])
            a[index, :, :given.shape[2]] = given
        cache[i] = kv_entry(arrays)

def trimmed(entry, layer_idx, live, room):  # a layer's cache: the live slots, positions < room
    if entry is None or deltanet(layer_idx):  # (a DeltaNet's notes have no positions)
        return entry and tuple(a[live] for a in entry)
    return kv_entry([mx.contiguous(a[live][:, :, :room]) for a in kv_arrays(entry)])

def attend_rows(cache, layer_idx, q, k, v, positions, visible):
    """q, k, v (B * L, heads, hd): L tokens of each of B rows at positions (B * L,), written into
    slot b -> (B * L, H * hd): Step 5's cache_write() and attend(), visible (B, L, S) each row's.
    A cache in bits (Part II) is written as the rest: its three arrays a kind, k and v quantised."""
    B, L, S = visible.shape
    q, k, v = (t.reshape(B, L, *t.shape[1:]) for t in (q, k, v))     # (B, L, heads, hd)
    room = -(-S // GROW) * GROW                                       # S up to a multiple of GROW
    entry = cache[layer_idx] or (mx.zeros((B, k.shape[2], room, k.shape[3]), k.dtype),) * 2
    new = [k.swapaxes(1, 2), v.swapaxes(1, 2)]                        # (B, 8, L, 128) each
    if hasattr(cache, "in_bits") and cache.in_bits(layer_idx, S - L):  # the longest row's start
        entry = to_bits(entry, cache)                                 # (B, 8, S', ..) x 3, twice
        new = [part for t in new for part in mx.quantize(t, group_size=cache.group_size,
                                                         bits=cache.bits)]  # (packed, ...) each
    arrays = [padded(a, 2, room) for a in kv_arrays(entry)]           # (B, 8, room, ..) each
    write_at = positions.reshape(B, 1, L, 1)                          # row b's L positions
    cache[layer_idx] = kv_entry([mx.put_along_axis(a, write_at, part, axis=2)
                                 for a, part in zip(arrays, new)])    # (B, 8, room, ..) each
    keys, values = kv_entry([a[:, :, :S] for a in kv_arrays(cache[layer_idx])])  # (B, 8, S,..)
    out = attend_batch(q, keys, values, visible)                      # (B, L, H * hd)
    return out.reshape(B * L, -1)                                     # (B * L, 2048)

def attend_batch(q, k, v, visible):
    """Step 5's attend() on B rows: a batch axis in front of each argument and each line. It is
    mx.vmap(attend), written out: under vmap MLX does not fuse the compiled mask (2 kernels more
    a layer, every step), so the batch's own lines keep Step 5's launches."""
    if isinstance(k, tuple):  # keys and values in bits: Part II
        return attend_batch_bits(q, k, v, visible)
    B, L, H, hd = q.shape
    by_kv = q.transpose(0, 2, 1, 3).reshape(B, k.shape[1], -1, L, hd)  # (B, 8, 2, L, 128)
    scores = by_kv @ k[:, :, None].swapaxes(-1, -2)                   # (B, 8, 2, L, S)
    scores = masked_scores(scores, visible[:, None, None], math.sqrt(hd))  # (B, 8, 2, L, S)
    probs = mx.softmax(scores, axis=-1).astype(v.dtype)               # (B, 8, 2, L, S)
    out = probs @ v[:, :, None]                                       # (B, 8, 2, L, 128)
    return out.reshape(B, H, L, hd).transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, 2048)

def attention_rows(x, layer_idx, cache, at):
    """Step 5 on B rows of L tokens each, flattened: x (B * L, D) at at.positions (B * L,)."""
    p = f"model.layers.{layer_idx}.self_attn."
    q, k, v = queries_keys_values(x, p, at.rope)                      # (B * L, 16, 128), ...
    out = attend_rows(cache, layer_idx, q, k, v, at.positions, at.visible)  # (B * L, 2048)
    return linear(out, p + "o_proj")                                  # (B * L, 1024)

def forward_rows(token_ids, cache, starts):
    """token_ids (B, L): L ids of each of B sequences, row b's at starts[b].. of slot b ->
    logits (B, L, vocab): Steps 2-8 on all rows at once (flattened to B * L rows of x)."""
    B, L = token_ids.shape
    x = embed(token_ids.reshape(-1))                                  # (B * L, 1024)
    positions = (mx.array(starts)[:, None] + mx.arange(L)).reshape(-1)  # (B * L,) each token's
    visible = mx.arange(max(starts) + L) <= positions.reshape(B, L, 1)  # (B, L, S) its own keys
    at = Pass(None, positions, rope_tables(positions, x.dtype), visible)  # (rope: (B * L, ...))
    for i in range(N_LAYERS):
        x = transformer_block(x, i, cache, at)                        # (B * L, 1024)
    return lm_head(x).reshape(B, L, -1)                               # (B, L, 151936)

def forward_batch(token_ids, cache, starts):  # one id of each row (B,) -> logits (B, vocab)
    return forward_rows(token_ids[:, None], cache, starts)[:, -1]     # (B, vocab)

def prefill_rows(prompts, like):
    """Step 9's prefill() side by side, all but each last id -> a cache, a slot each, kept as
    like is (a KVCache: in bits). Qwen3's shorter prompts padded at the end (keys written over
    before any query sees them)."""
    longest = max(len(ids) for ids in prompts) - 1
    earlier = mx.array([ids[:-1] + [0] * (longest + 1 - len(ids)) for ids in prompts])  # (G, ..)
    cache = copy.copy(like)
    cache[:] = [None] * N_LAYERS
    for i in range(0, longest, CHUNK):
        forward_rows(earlier[:, i:i + CHUNK], cache, [i] * len(prompts))
        mx.eval(cache)
    return cache

def seat(waiting, slots, batch_size, cache):
    """Waiting prompts (Rows) into the free slots, up to batch_size, each prompt's cache filled
    apart (prefill_rows(), several side by side) and taken into the batch's (take_slots())."""
    joining = []
    while waiting and (None in slots or len(slots) < batch_size):  # a free slot: a prompt
        if None in slots:  # one a sequence left
            b = slots.index(None)
            slots[b] = waiting.pop(0)
        else:  # a new one at the end
            b = len(slots)
            slots.append(waiting.pop(0))
        joining.append(b)
    prefills = {}  # slot numbers prefilled side by side: Qwen3's all, Qwen3.5's by length
    for b in joining:  # (a DeltaNet's notes cannot be padded: its rows of one length each)
        length = len(slots[b].ids) if MODEL == "qwen3_5" else 0
        prefills.setdefault(length, []).append(b)
    for numbers in prefills.values():
        take_slots(cache, numbers, prefill_rows([slots[b].ids for b in numbers], cache))

def generate_batch(prompts, max_tokens=100, sampler=sample, batch_size=8, ended=None,
                   cache=None):
    """Yield (i, id) for the tokens of prompts[i] (lists of ids): greedy, each as generate() gives
    it alone; sampled, from the same distributions (the draws are the batch's, not a lone run's).
    Up to batch_size sequences decode together; one that ends (EOS, max_tokens, the context's end)
    frees its slot, and the next waiting prompt fills its cache apart and takes it: continuous
    batching. ended: a list, given (i, the positions its cache held, whether in bits) as each
    sequence ends;
    cache: empty, an entry a layer for all slots (a KVCache: in bits once its longest row holds
    quantized_start positions)."""
    waiting, slots = [Row(i, ids, max_tokens) for i, ids in enumerate(prompts)], []
    cache = [None] * N_LAYERS if cache is None else cache  # slots[b]: the Row in slot b
    while waiting or slots:
        seat(waiting, slots, batch_size, cache)
        # A joining row's last id rides in the next batch pass at its own position: that row's
        # logits are its prompt's, and the weights are read once for all rows, not once more.
        # Free slots go once no prompt is left to take them; positions past every row's reach
        # (a long row's, ended) go whenever the buffers hold more, as mlx-lm's BatchKVCache.filter
        # trims: copies of what is kept (a slice alone is a view: it keeps the whole buffer).
        live = [b for b, row in enumerate(slots) if row is not None]
        if not live:  # every prompt done
            return
        room = -(-(max(slots[b].pos for b in live) + 1) // GROW) * GROW  # the next pass's buffer
        buffered = max([kv_arrays(entry)[0].shape[2] for i, entry in enumerate(cache)
                        if entry is not None and not deltanet(i)], default=0)
        if len(live) < len(slots) or buffered > room:
            cache[:] = [trimmed(entry, i, mx.array(live), room) for i, entry in enumerate(cache)]
            slots = [slots[b] for b in live]
        tokens = mx.stack([row.token for row in slots])               # (B,) each row's, lazy
        checks = mx.stack([row.finite for row in slots])              # (B,) its logits finite?
        # The next pass is queued before the tokens it follows are looked at, as in generate().
        if any(row.pos + 1 < row.end for row in slots):  # a next token is wanted
            logits = forward_batch(tokens, cache, [row.pos for row in slots])  # (B, vocab)
            upcoming, finite = sampler(logits), mx.isfinite(logits).all(axis=-1)  # (B,) each
            mx.async_eval(upcoming, finite)
        ids, oks = tokens.tolist(), checks.tolist()
        for b, row in enumerate(slots):
            token = ids[b] if row.pos >= len(row.ids) else None  # None: its prompt's last id
            if token is not None and not oks[b]:
                raise not_finite(f"of prompt {row.i + 1}", logits.dtype)
            if token is not None and token not in EOS_IDS:
                yield row.i, token
            if token in EOS_IDS or row.pos + 1 >= row.end:  # it ends: its slot is free
                slots[b] = None
                if ended is not None:  # its positions before its last id; in bits?
                    ended.append((row.i, row.pos, any(isinstance(entry, Quantized)
                                                      for entry in cache)))
            else:
                row.token, row.finite = upcoming[b], finite[b]        # () each
                row.pos += 1

# ═══ Several machines — each process holds 1/N of every block; 2 sums a block join them ═══
# A model too big for one Mac runs on N: mlx.launch starts one process (a rank) on each, and they
# talk through mx.distributed. Each rank holds whole heads, the rows of q, k and v that make them
# and the columns of o that read them; of the MLP, rows of gate and up, and the columns of down
# that read them. So each block's attention and MLP leave a part of their output on every rank,
# and Part I's linear() adds the N parts after o_proj and down_proj (the columns split, SPLIT's
# -1): one all_sum each, 2 a block, every rank the whole sum.
# The embedding, the norms and the LM head stay whole on every rank; its KV cache holds its own
# heads. Qwen3.5's DeltaNet splits the same way, by its key and value heads.
SPLIT = {  # a weight's module (or a tensor's name) -> the axis cut in N: -2, rows; -1, columns
    "q_proj": -2, "k_proj": -2, "v_proj": -2, "o_proj": -1, "gate_proj": -2, "up_proj": -2,
    "down_proj": -1, "in_proj_qkv": -2, "conv1d": -2, "in_proj_z": -2, "in_proj_b": -2,
    "in_proj_a": -2, "dt_bias": -1, "A_log": -1, "out_proj": -1,  # (a vector: its one axis)
    "gate_up_proj": -2}  # (a MoE's experts, stacked: (E, rows, columns), each expert cut)

def shard(name, w, group, qwen35):
    """A tensor of the whole model -> this rank's part of it (the whole if it is not split),
    copied and evaluated now: a slice would keep the whole tensor's buffer alive, and one eval
    over them all could hold every whole tensor at once."""
    *_, module, leaf = name.split(".")
    axis = SPLIT.get(module if leaf in ("weight", "scales", "biases") else leaf)
    if axis is None:
        return w
    n, r = group.size(), group.rank()
    segments = [w]  # rows of parts one after another are cut part by part
    if module in ("in_proj_qkv", "conv1d"):  # q, k and v: each cut by heads
        keys = qwen35["linear_num_key_heads"] * qwen35["linear_key_head_dim"]  # 2048
        segments = mx.split(w, [keys, 2 * keys], axis=axis)           # 3 x (2048, 1024)
    elif "gate_up_proj" in (module, leaf):  # each expert's gate, then its up
        segments = mx.split(w, 2, axis=axis)                          # 2 x (128, 768, 2048)
    cut = mx.concatenate([mx.split(s, n, axis=axis)[r] for s in segments], axis=axis)   # 1/N
    cut = mx.contiguous(cut)                                          # 1/N of it
    mx.eval(cut)
    return cut

# ═══ Mixture of experts — a router sends each token to k of E feed-forward networks ═══
# Qwen3-30B-A3B's MLP, in each of its 48 blocks, is 128 experts, each a Step 6 SwiGLU 768 wide.
# A router, one more linear layer, scores them for each token; the token goes through its 8
# likeliest, and their outputs are added, weighted by the router. So a token reads 3B of the
# 30B parameters: decoding moves a tenth of the bytes a dense model of its size would (and so it
# is fast on a Mac), but from 8 scattered places a block. Qwen3.5's add a shared expert, which
# every token goes through, its output gated. The experts are held stacked, (E, rows, columns),
# and MLX's gather products run each token's k of them in one call a projection.
def moe(x, layer_idx, routes=None):
    """x: (L, D) -> (L, D). The router's probabilities over the E experts (a softmax, in float32),
    each token's k likeliest (renormalised to sum to 1 when norm_topk_prob), those experts'
    SwiGLU of the token, weighted and added; Qwen3.5's shared expert added through its sigmoid
    gate. As a loop (tests/test_moe.py holds the two equal): for each token t and each of its k
    experts e, y[t] += mix[t, e] * down_e(silu(gate_e(x[t])) * up_e(x[t])). routes: a list,
    given (layer_idx, the choices (L, k), their weights (L, k))."""
    p, top_k = f"model.layers.{layer_idx}.mlp.", MOE["num_experts_per_tok"]
    probs = mx.softmax(linear(x, p + "gate").astype(mx.float32), axis=-1)  # (L, 128) router
    chosen = mx.argpartition(probs, -top_k, axis=-1)[:, -top_k:]      # (L, 8) its 8 likeliest
    mix = mx.take_along_axis(probs, chosen, axis=-1)                  # (L, 8)
    if MOE["norm_topk_prob"]:
        mix = mix / mix.sum(axis=-1, keepdims=True)                   # (L, 8) summing to 1
    if routes is not None:  # --explain's view of the experts at work
        routes.append((layer_idx, chosen, mix))
    if p in POOLS:  # experts from disk (below): a pool of them in memory
        out = streamed_experts(x, chosen, p)                          # (L, 8, 2048)
    else:
        out = experts(x, chosen, p + "experts.")                      # (L, 8, 2048)
    y = (out * mix[..., None].astype(out.dtype)).sum(axis=-2)         # (L, 2048)
    if p + "shared_expert_gate.weight" in W:  # Qwen3.5's: every token's, gated
        s = p + "shared_expert."
        h = swiglu(linear(x, s + "gate_proj"), linear(x, s + "up_proj"))  # (L, 512)
        gate = mx.sigmoid(linear(x, p + "shared_expert_gate"))         # (L, 1)
        y = y + gate * linear(h, s + "down_proj", summed=False)       # (L, 2048)
    if GROUP is not None:  # several processes: each holds part of every expert, added once
        y = mx.distributed.all_sum(y, group=GROUP)                    # (L, 2048)
    return y

def experts(x, chosen, p):
    """x (L, D), chosen (L, k) -> each chosen expert's SwiGLU of its token (L, k, D): two gather
    products over the stacked experts, p + "gate_up_proj" (E, 2I, D), gate's rows first, and
    p + "down_proj" (E, D, I). Many tokens (a prompt) are sorted by expert first, as mlx-lm does,
    so that each expert's rows are read once for all its tokens; then put back in order."""
    L, top_k = chosen.shape
    if chosen.size < 64:  # a few tokens (decoding): each row of x its k experts
        rows, picks, order = x[:, None, None, :], chosen, None        # (L, 1, 1, D), (L, k)
    else:
        order = mx.argsort(chosen.reshape(-1))                        # (L k,) by expert
        rows, picks = x[order // top_k][:, None, :], chosen.reshape(-1)[order]  # (L k, 1, D)
    gate, up = mx.split(gathered(rows, p + "gate_up_proj", picks, order), 2, axis=-1)
    out = gathered(swiglu(gate, up), p + "down_proj", picks, order)   # (..., 1, D)
    if order is None:
        return out[..., 0, :]                                         # (L, k, D)
    return out[mx.argsort(order)].reshape(L, top_k, -1)               # (L, k, D) in token order

def gathered(x, name, picks, order):
    """x (..., 1, in) @ W[name][e].T for each row's expert e in picks: mx.gather_mm (quantised:
    mx.gather_qmm, with quantized_linear()'s layout); order: the rows come sorted by expert."""
    w, in_order = W[name], order is not None
    if name + ".scales" in W:
        scales = W[name + ".scales"]
        bits, group_size = w.shape[-1] * 32 // x.shape[-1], x.shape[-1] // scales.shape[-1]
        return mx.gather_qmm(x, w, scales, W[name + ".biases"], rhs_indices=picks,
                             group_size=group_size, bits=bits, sorted_indices=in_order)
    if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
        # MLX's CPU gathers in float32 only (0.32): the experts are cast for the product, a copy
        # of the layer's each time (slow; --dtype float32 keeps them so).
        y = mx.gather_mm(x.astype(mx.float32), w.swapaxes(-1, -2).astype(mx.float32),
                         rhs_indices=picks, sorted_indices=in_order)
        return y.astype(x.dtype)                                      # (..., 1, out)
    return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=picks, sorted_indices=in_order)

# ═══ Long context — YaRN: RoPE's slow clock hands slowed further, to reach past training ═══
# A model trained on 32,768 positions has pairs of dimensions whose hands never went round within
# them; past that, their angles are new to it. YaRN (Peng et al. 2023) divides those pairs'
# frequencies by factor, so that 4 x 32,768 positions turn them no further than training did,
# keeps the fast pairs (they went round many times), blends those between on a ramp, and scales
# cos and sin by 0.1 ln(factor) + 1 (so q and k each, q k by its square), the softmax's sharpness
# back. It is static: short texts are turned so too, which Qwen says costs them a little: use
# it only for long ones.
def yarn(freqs):
    """RoPE's frequencies f_i (half,) -> YaRN's, and the scale of cos and sin, as transformers
    computes them from rope_scaling's factor, original_max_position_embeddings, beta_fast (32),
    beta_slow (1), truncate (true) and attention_factor: pair i kept if it turns more than
    beta_fast times over the original context, divided by factor if fewer than beta_slow."""
    half, factor, original = len(freqs), YARN["factor"], YARN["original_max_position_embeddings"]

    def pair(turns):  # where, between 0 and half, a pair turns that many times over the original
        return half * math.log(original / (turns * 2 * math.pi)) / math.log(THETA)
    low, high = pair(YARN.get("beta_fast", 32)), pair(YARN.get("beta_slow", 1))
    if YARN.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, 2 * half - 1)
    ramp = mx.clip((mx.arange(half, dtype=mx.float32) - low) / (high - low or 0.001), 0, 1)
    scale = YARN.get("attention_factor") or (0.1 * math.log(factor) + 1 if factor > 1 else 1.0)
    return freqs / factor * ramp + freqs * (1 - ramp), scale          # (64,), a number

# ═══ Experts from disk — a pool of slots a block; an expert not held is read when picked ═══
# Qwen3-30B-A3B is 17 GB at 4 bits, nearly all of it experts, yet a token reads 8 of each block's
# 128. When the weights exceed the memory they may hold (--memory; else what this machine can),
# everything but the experts loads as before, and each mixture block keeps a pool of S slots. A
# token's picks that no slot holds are read from the safetensors files by their byte ranges (in a
# stacked tensor, expert e is one contiguous range; os.preadv reads it) into a free slot, or the
# one used least recently; then the gather products run over the slots, each pick renumbered to
# its slot: the same products, so the same numbers. A token costs about its compute plus the
# bytes it missed over the disk's read speed. The MTP head's experts stay in memory.
POOLS = {}  # a streamed block's "model.layers.N.mlp." -> its Pool; {}: every expert in memory

STORED = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "U32": mx.uint32}

READS_AT_ONCE = 8  # a block's missing experts read 8 at a time: a disk (an SSD most) answers
# several requests at once faster than one after another; os.preadv lets go of Python's lock
READERS = ThreadPoolExecutor(8)  # (its threads start at the first read; 8: READS_AT_ONCE's most)

POOLS_COUNTED = ("found", "wanted", "bytes", "seconds", "disk")  # picks held, picks; bytes read,
# the seconds reading and writing them in, the seconds a read was under way

class Pool:
    """One mixture block's expert slots: W[name] (S, ...) for each name in spans, {name: (the
    dtype stored, one expert's shape, [each expert's [(file, offset, bytes), ...]])}; files:
    {file: (size, mtime) as loaded}. Counts what it found and read, for the statistics."""
    def __init__(self, spans, files, size):
        self.spans, self.files, self.size = spans, files, size
        self.slot_of = {}  # expert -> slot, the least recently used first
        self.counts = dict.fromkeys(POOLS_COUNTED, 0)

    def bring(self, needed):
        """needed: expert ids, at most S -> (E,) each expert's slot (0 if not held), all of
        needed held: each missing one read into a free slot, else the least recently used's."""
        missing = [e for e in needed if e not in self.slot_of]
        for e in needed:
            if e in self.slot_of:  # found: now the most recently used
                self.slot_of[e] = self.slot_of.pop(e)
        self.counts["found"] += len(needed) - len(missing)
        self.counts["wanted"] += len(needed)
        free = sorted(set(range(self.size)) - set(self.slot_of.values()))
        slots = [free.pop(0) if free else self.slot_of.pop(next(iter(self.slot_of)))
                 for _ in missing]
        self.read(missing, slots)  # (if it fails, the slots are left free: none claims a read)
        self.slot_of.update(zip(missing, slots))
        table = [0] * len(next(iter(self.spans.values()))[2])
        for e, slot in self.slot_of.items():
            table[e] = slot
        return mx.array(table)                                        # (E,)

    def read(self, missing, slots):
        """The missing experts' bytes from the files into their slots of each W[name]: READERS
        read up to READS_AT_ONCE experts ahead while this thread writes those read in (MLX gives
        a slot's write the pool's buffer). Besides the pool: at most that many experts' bytes,
        and MLX's copy of the tensor going into its slot."""
        tic, intervals, reads = time.perf_counter(), [], []  # intervals: each read's (start, end)
        try:
            reads = [self.ask_for(e, intervals) for e in missing[:READS_AT_ONCE]]
            for n, slot in enumerate(slots):
                for name, data in reads[n].result().items():
                    stored, shape, _ = self.spans[name]
                    w = mx.array(memoryview(data)).view(STORED[stored]).reshape(shape)  # (2I, D)..
                    W[name][slot] = w.astype(W[name].dtype)           # an expert's, in its slot
                    mx.eval(W[name])
                    self.counts["bytes"] += len(data)
                reads[n] = w = data = None  # (let go before the next expert's bytes come)
                if n + READS_AT_ONCE < len(missing):
                    reads.append(self.ask_for(missing[n + READS_AT_ONCE], intervals))
        finally:  # (a read failed, or Ctrl-C: reads under way finish, their bytes unused)
            self.counts["seconds"] += time.perf_counter() - tic
            self.counts["disk"] += under_way(intervals)

    def ask_for(self, e, intervals):
        """Expert e's reads, handed to READERS -> a Future of its bytes, {name: bytearray}, each
        name's ranges joined (gate_up: gate's rows, then up's). The buffers are made here, in
        this thread: a reader's own would stay in that thread's memory pool (glibc's malloc keeps
        an arena a thread), and add to what the process holds."""
        buffers = {name: bytearray(sum(size for _, _, size in ranges[e]))
                   for name, (_, _, ranges) in self.spans.items()}
        return READERS.submit(self.fill, e, buffers, intervals)

    def fill(self, e, buffers, intervals):
        """(In a reader thread) buffers <- expert e's bytes; intervals gets each read's (start,
        end) -> buffers."""
        for name, (_, _, ranges) in self.spans.items():
            at = 0
            for file, offset, size in ranges[e]:
                start = time.perf_counter()
                read_span(memoryview(buffers[name])[at:at + size], file, offset, self.files[file])
                intervals.append((start, time.perf_counter()))
                at += size
        return buffers

def under_way(intervals):  # [(start, end)] -> the seconds at least one of them was under way
    total, reach = 0.0, 0.0
    for start, end in sorted(intervals):
        total, reach = total + max(0.0, end - max(start, reach)), max(reach, end)
    return total

def read_span(into, file, offset, loaded):
    """into (a writable view): as many bytes of file from offset; the file as it was loaded
    ((size, mtime)), else a UserError."""
    try:
        fd = os.open(file, os.O_RDONLY)
        try:
            now, got = os.fstat(fd), 0
            if (now.st_size, now.st_mtime_ns) == loaded:
                got = os.preadv(fd, [into], offset)
        finally:
            os.close(fd)
    except OSError as e:
        raise UserError(f"{file} cannot be read: {e.strerror.lower()}") from None
    if got != len(into):  # changed (or cut short) since the experts' places were read
        raise UserError(f"{file} has changed since it was loaded: run again")

def streamed_experts(x, chosen, p):
    """experts() for a streamed block: its picks read now (the reads need them), its tokens in
    turns whose picks fit the pool, each turn's products over the slots, evaluated before the
    next turn's reads write over them -> (L, k, D)."""
    pool, picks = POOLS[p], chosen.tolist()                            # (L, 8) ids
    outs, start = [], 0
    while start < len(picks):
        needed, end = set(picks[start]), start + 1
        while end < len(picks) and len(needed | set(picks[end])) <= pool.size:
            needed, end = needed | set(picks[end]), end + 1
        slots = pool.bring(sorted(needed))[chosen[start:end]]          # (turn, 8) each's slot
        outs.append(experts(x[start:end], slots, p + "experts."))      # (turn, 8, 2048)
        mx.eval(outs[-1])
        start = end
    return mx.concatenate(outs)                                        # (L, 8, 2048)

def safetensors_header(file):
    """A safetensors file's tensors -> {name: (dtype, shape, offset in the file, bytes)}: its
    first 8 bytes give the length of a JSON header, which gives each tensor's place after it."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {name: (t["dtype"], t["shape"], 8 + length + t["data_offsets"][0],
                   t["data_offsets"][1] - t["data_offsets"][0])
            for name, t in header.items() if name != "__metadata__"}

def expert_spans(p, places, e):
    """Block p's experts in the files -> Pool's spans, named as stacked (experts.gate_up_proj and
    experts.down_proj, with .scales and .biases if quantised): (dtype stored, one expert's shape,
    each expert's [(file, offset, bytes)]). places: {tensor: (file, dtype, shape, offset,
    bytes)}."""
    def each(name):  # a stacked tensor's bytes, expert by expert (each one contiguous range)
        file, dtype, shape, offset, size = places[name]
        return dtype, shape[1:], [[(file, offset + n * size // e, size // e)] for n in range(e)]

    def joined(gate, up):  # gate's rows, then up's: gate_up, as stack_experts() joins them
        (dtype, shape, g), (_, _, u) = gate, up
        return dtype, [2 * shape[0], *shape[1:]], [a + b for a, b in zip(g, u)]
    if p + "experts.gate_up_proj" in places:  # Qwen3.5-MoE's release: stacked already
        return {p + "experts." + m: each(p + "experts." + m) for m in ("gate_up_proj", "down_proj")}
    if p + "experts.0.gate_proj.weight" in places:  # Qwen3-MoE's: one tensor an expert
        one = {m: [places[f"{p}experts.{n}.{m}_proj.weight"] for n in range(e)]
               for m in ("gate", "up", "down")}
        alone = {m: (one[m][0][1], one[m][0][2], [[(f, offset, size)] for f, _, _, offset, size
                                                  in one[m]]) for m in one}
        return {p + "experts.gate_up_proj": joined(alone["gate"], alone["up"]),
                p + "experts.down_proj": alone["down"]}
    spans = {}  # MLX's switch_mlp: gate and up stacked apart; a narrow down maybe unquantised
    for part in ("", ".scales", ".biases"):
        gate, up, down = (f"{p}switch_mlp.{m}_proj{part or '.weight'}" for m in ("gate", "up",
                                                                                "down"))
        if gate in places:
            spans[f"{p}experts.gate_up_proj{part}"] = joined(each(gate), each(up))
        if down in places:
            spans[f"{p}experts.down_proj{part}"] = each(down)
    return spans

# ═══ The KV cache in fewer bits — keys and values kept as the weights are: 8 or 4 bits a number ═══
# Qwen3-0.6B's cache holds 28 x 2 x 8 x 128 numbers a token, 112 KB in bfloat16: 15 GB at YaRN's
# 131,072 positions. Kept in bits as the weights are (a scale and a bias for each group of 64
# numbers along a head's width), 8 bits hold it in 53% of that, 4 bits in 28%. A cache made with
# bits (KVCache) stays in the model's dtype until it holds quantized_start positions, converts, and
# quantises each key and value as it is written; attention reads it through mx.quantized_matmul,
# never writing the unpacked keys out: mlx-lm's quantised attention, and its three flags.
class KVCache(list):
    """A cache (entries: one a layer, [None] * N_LAYERS at first) whose keys and values go into
    bits (2 to 6, or 8), in groups of group_size along a head's width, once it holds
    quantized_start positions: at its first write after the pass that reached them, as mlx-lm
    converts its cache after a pass (so never in the first pass)."""
    def __init__(self, entries, bits, group_size=64, quantized_start=5000):
        super().__init__(entries)
        self.bits, self.group_size, self.quantized_start = bits, group_size, quantized_start

    def in_bits(self, layer_idx, start):  # does a write at start go into bits?
        return isinstance(self[layer_idx], Quantized) or start >= max(self.quantized_start, 1)

class Quantized(NamedTuple):  # a layer's keys and values in bits: (packed, scales, biases) each
    keys: tuple       # (KV, S, hd * bits / 32) uint32, (KV, S, hd / group) twice
    values: tuple

def cache_write_bits(cache, layer_idx, k, v, start):
    """cache_write() into bits: a 16-bit entry converted first (its buffers quantised whole), then
    k, v (L, KV, hd) quantised and written at start.. -> the keys and values so far, (packed,
    scales, biases) each, (KV, S, ...)."""
    end = start + k.shape[0]
    entry = cache[layer_idx] or (mx.zeros((k.shape[1], end, k.shape[2]), k.dtype),) * 2  # (a
    # first write past 0: the MTP head's cache, a chat's next turn; positions before, unseen)
    entry = to_bits(entry, cache)  # (the keys and values so far, in the model's dtype: in bits)
    if entry.keys[0].shape[1] < end:  # full: up to end, rounded up to GROW
        entry = Quantized(*(tuple(padded(a, 1, -(-end // GROW) * GROW) for a in kind)
                            for kind in entry))                       # (KV, S rounded up, ...)
    bits, group = kv_format(entry.keys, k.shape[-1])
    for kind, new in zip(entry, (k, v)):
        parts = mx.quantize(new.transpose(1, 0, 2), group_size=group, bits=bits)  # (KV, L, ...)
        for a, part in zip(kind, parts):
            a[:, start:end] = part                                    # positions start..end-1
    cache[layer_idx] = entry
    return cut_at(entry, end)                                         # (KV, S, ...) each

def kv_format(packed, hd):  # a cache's (packed, scales, biases) -> its bits and group size
    return packed[0].shape[-1] * 32 // hd, hd // packed[1].shape[-1]

def kv_arrays(entry):  # a layer's keys and values -> their arrays (in bits: three each)
    return [*entry.keys, *entry.values] if isinstance(entry, Quantized) else list(entry)

def kv_entry(arrays):  # kv_arrays()'s arrays -> the layer's keys and values again
    return Quantized(tuple(arrays[:3]), tuple(arrays[3:])) if len(arrays) == 6 else tuple(arrays)

def to_bits(entry, cache):  # a layer's keys and values in bits, as cache (a KVCache) keeps them
    if isinstance(entry, Quantized):
        return entry
    return Quantized(*(mx.quantize(a, group_size=cache.group_size, bits=cache.bits)
                       for a in entry))

def cut_at(entry, end):  # a layer's keys and values, positions 0..end-1 (None: all)
    if isinstance(entry, Quantized):
        return Quantized(*(tuple(a[:, :end] for a in kind) for kind in entry))
    return entry[0][:, :end], entry[1][:, :end]

def attend_bits(q, keys, values, visible):
    """Step 5's attend() on keys and values in bits: q (L, H, hd), keys, values (packed, scales,
    biases) (KV, S, ...) -> (L, H * hd). The products read the packed numbers directly."""
    L, H, hd = q.shape
    bits, group = kv_format(keys, hd)
    by_kv = q.transpose(1, 0, 2).reshape(len(keys[0]), -1, L, hd)     # (8, 2, L, 128)
    scores = mx.quantized_matmul(by_kv, *(a[:, None] for a in keys), transpose=True,
                                 group_size=group, bits=bits)         # (8, 2, L, S) q k^T
    scores = masked_scores(scores, visible, math.sqrt(hd))            # (8, 2, L, S) float32
    probs = mx.softmax(scores, axis=-1).astype(q.dtype)               # (8, 2, L, S)
    out = mx.quantized_matmul(probs, *(a[:, None] for a in values), transpose=False,
                              group_size=group, bits=bits)            # (8, 2, L, 128) probs v
    return out.reshape(H, L, hd).transpose(1, 0, 2).reshape(L, -1)    # (L, 2048)

def attend_batch_bits(q, keys, values, visible):
    """attend_bits() on B rows, as attend_batch() is attend() on them: q (B, L, H, hd), keys and
    values (packed, scales, biases) (B, KV, S, ..) -> (B, L, H * hd)."""
    B, L, H, hd = q.shape
    bits, group = kv_format(keys, hd)
    by_kv = q.transpose(0, 2, 1, 3).reshape(B, keys[0].shape[1], -1, L, hd)  # (B, 8, 2, L, 128)
    scores = mx.quantized_matmul(by_kv, *(a[:, :, None] for a in keys), transpose=True,
                                 group_size=group, bits=bits)         # (B, 8, 2, L, S)
    scores = masked_scores(scores, visible[:, None, None], math.sqrt(hd))  # (B, 8, 2, L, S)
    probs = mx.softmax(scores, axis=-1).astype(q.dtype)               # (B, 8, 2, L, S)
    out = mx.quantized_matmul(probs, *(a[:, :, None] for a in values), transpose=False,
                              group_size=group, bits=bits)            # (B, 8, 2, L, 128)
    return out.reshape(B, H, L, hd).transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, 2048)

# ═══ Part III — See inside: the views that teach, for --explain and for a notebook ═══
# Each takes plain values (ids, a cache, numbers), never the command line's flags.
import copy, os, shutil, sys, textwrap, timeit, unicodedata  # noqa: E401, E402
from collections import Counter  # noqa: E402
from functools import lru_cache  # noqa: E402

# ─── The tokens, and the next token ───

def shown(token):  # a token's text, quoted (a leading space shows), special tokens by name
    return repr(TOK.decode([token], skip_special_tokens=False))

def top_tokens(logits, n, which="the prompt"):
    """logits (vocab,) -> the n likeliest tokens [(id, probability)], softmax at temperature 1."""
    probs = mx.softmax(logits.astype(mx.float32))                     # (vocab,)
    if not mx.isfinite(probs).all().item():
        raise not_finite(f"after {which}", logits.dtype)
    top = mx.argsort(-probs)[:n].tolist()                             # (n,) likeliest first
    return [(t, probs[t].item()) for t in top]

def bar_line(label, token, p):  # a line of a probability table: 30 blocks for p = 1
    return f"{label:>10} {shown(token):>18} {p:<8.4g}{'█' * round(30 * p)}"

def print_top(logits, n):  # the n likeliest next tokens, a probability bar each
    print("\n".join(bar_line("", token, p) for token, p in top_tokens(logits, n)))

def explain(prompt_ids, blocks, logits, cache, start, n):
    """--explain, before the answer: the tokens, the top n next tokens, then where the prompt's
    last token looks in each attention block (blocks: its x after each)."""
    print("tokens:", ", ".join(f"{shown(t)} {t}" for t in prompt_ids))
    print(f"embedding: {embed(prompt_ids).shape}")
    print(f"the next token: the model's top {n}")
    print_top(logits, n)
    heads = "heads" if GROUP is None else f"rank 0's {N_HEADS // GROUP.size()} heads of {N_HEADS}"
    print("where the last token looks: each attention block's 3 heaviest tokens of the prompt "
          f"(averaged over {heads})")
    for i, looks in attention_looks(prompt_ids, blocks, cache, start):
        looks = looks[start:].tolist()                                # the prompt's positions
        top = sorted(range(len(looks)), key=looks.__getitem__, reverse=True)[:3]
        for rank, j in enumerate(top):
            print(bar_line(f"block {i}" if rank == 0 else "", prompt_ids[j], looks[j]))
        print(f"{'':>10} {'rest':>18} {1 - sum(looks[j] for j in top):<8.4g}")
    delta = [str(i + 1) for i in range(N_LAYERS) if deltanet(i)]
    if delta:
        print(f"blocks {', '.join(delta)}: Gated DeltaNet, compressed notes: no such weights")

# ─── Where the last token looks ───

def attention_looks(prompt_ids, blocks, cache, start=0):
    """Where the prompt's last token looks, in each full-attention block: Step 5's scores and
    softmax run once more for its query, on the keys the cache holds (memory: S per head) ->
    [(block, (S,))], averaged over heads. blocks: x after each block, for the last token."""
    S = start + len(prompt_ids)
    position, looks = mx.array([S - 1]), []
    for i in [i for i in range(N_LAYERS) if not deltanet(i)]:
        x = embed(prompt_ids[-1:]) if i == 0 else blocks[i - 1]       # (1, D) block i's input
        h = rms_norm(x, W[f"model.layers.{i}.input_layernorm.weight"], EPS)
        if MODEL == "qwen3_5":
            q = gated_queries(h, i, position)[0]                      # (1, heads, hd)
        else:
            rope = rope_tables(position, h.dtype)
            q = queries_keys_values(h, f"model.layers.{i}.self_attn.", rope)[0]
        keys = cache[i][0]                                            # (KV, S, hd)
        if isinstance(cache[i], Quantized):  # in bits: unpacked, as dequantize() reads them
            keys = dequantize(*keys, kv_format(keys, D_HEAD)[0])
        keys = keys[:, :S]
        by_kv = q.reshape(keys.shape[0], -1, keys.shape[-1])          # (KV, 2, hd) as attend()'s
        scores = masked_scores(by_kv @ keys.swapaxes(-1, -2), mx.array(True), math.sqrt(
            keys.shape[-1]))                                          # (KV, 2, S) all visible
        looks.append((i + 1, mx.softmax(scores, axis=-1).reshape(-1, S).mean(axis=0)))  # (S,)
    return looks

# ─── The answer forming ───

def logit_lens(token_ids, written, cache, start=0, chunk=CHUNK, progress=False, routes=None):
    """The logit lens (nostalgebraist, 2020) over an answer. token_ids (the prompt, then the answer
    but its last id) at positions start.. run once more, on a cache of their own that goes on from
    cache as it was at start (cache itself is never written); at each of the last len(written)
    positions, each block's output goes through the final RMSNorm and the LM head, as though the
    model ended after that block -> top, p, p_top (blocks, len(written)): each block's likeliest
    next token, the probability it gives the token written there, and its top one's. Memory: the
    positions' ids and cache, and one block's logits for a chunk of them at a time. progress: a
    line on stderr at a terminal, taken away on every way out. routes: a list, given what each
    mixture of experts chose at every position (moe()'s (block, chosen, mix), a chunk's)."""
    first_col = len(token_ids) - len(written)                         # the first column's place
    if first_col < 0:
        raise ValueError(f"{len(written)} ids written after {len(token_ids)} positions")
    # Keys and values cut at start: the first write past it grows them into new buffers, and so
    # never lands in the run's. A DeltaNet's notes are new arrays at every token.
    own = copy.copy(cache)  # (a cache in bits, KVCache, stays one)
    own[:] = [entry if entry is None or deltanet(i) else cut_at(entry, start)
              for i, entry in enumerate(cache)]
    kept = [[(mx.zeros(0, mx.uint32), mx.zeros(0), mx.zeros(0))] for _ in range(N_LAYERS)]
    progress, line = progress and sys.stderr.isatty(), ""  # line: the progress line shown
    try:
        # Passes of chunk ids, the answer's first column beginning one, as the run's decoding
        # began a pass there (a cache in bits, KVCache, then converts where the run's did).
        bounds = sorted({*range(0, len(token_ids), chunk), first_col} - {len(token_ids)})
        for i, j in zip(bounds, bounds[1:] + [len(token_ids)]):
            ids, blocks = token_ids[i:j], []
            forward(ids, own, start + i, blocks, routes=routes)       # its logits never computed
            col0 = max(first_col - i, 0)                              # the chunk's first column
            if col0 < len(ids):  # columns in this chunk
                wrote = mx.array(written[i + col0 - first_col:i + len(ids) - first_col])  # (C,)
                for b, (block_kept, x) in enumerate(zip(kept, blocks), 1):
                    # Its own final norm: lm_head() normalises this block's x by its own size.
                    logits = lm_head(x[col0:]).astype(mx.float32)     # (C, vocab)
                    lse = mx.logsumexp(logits, axis=-1)               # (C,) softmax's divisor
                    taken = mx.take_along_axis(logits, wrote[:, None], axis=-1)[:, 0]  # (C,)
                    block_kept.append((mx.argmax(logits, axis=-1), mx.exp(taken - lse),
                                       mx.exp(logits.max(axis=-1) - lse)))  # (C,) each
                    mx.eval(block_kept[-1])                           # all that is kept of them
                    if not mx.isfinite(block_kept[-1][1]).all().item():
                        raise not_finite(f"of block {b}'s logit lens", x.dtype)
                    if progress:
                        line = (f"[the logit lens: positions {i + len(ids)} of "
                                f"{len(token_ids)}, block {b} of {N_LAYERS}]")
                        print(f"\r{line}", end="", file=sys.stderr, flush=True)
            mx.eval(own, routes or [])
    finally:  # the line blanked (spaces: a dumb terminal has no codes to clear it)
        print(f"\r{' ' * len(line)}\r" if line else "", end="", file=sys.stderr, flush=True)
    return [mx.stack([mx.concatenate([chunk_kept[field] for chunk_kept in block_kept])
                      for block_kept in kept]) for field in range(3)]

# GPT-2's byte-level alphabet, which Qwen's tokenizer.json spells its tokens in: a byte that is a
# printable Latin-1 character is itself, the others are chr(256), chr(257), ... in order.
PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]

BYTE_OF = {chr(b): b for b in PRINTABLE} | {
    chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in PRINTABLE)}

SHADES = "▁▂▃▄▅▆▇█"  # a probability under 1/8, under 2/8, ..., 7/8 or more

CELL = 7  # the terminal columns of a token's text in a cell of the picture

def cell_text(token, width=CELL):
    """A token's text in exactly width terminal columns: a space as ·, a newline as ↵, a wide
    character in two, a part of a UTF-8 character as its bytes (<0xE4>), a whole one that prints
    nothing as its code point (U+00A0); a longer text is cut with … between characters."""
    spelt = TOK.id_to_token(token)  # None: a row of the LM head past the tokenizer's tokens
    text = f"#{token}" if spelt is None else TOK.decode([token], skip_special_tokens=False)
    if "\ufffd" in text and all(c in BYTE_OF for c in spelt):  # a piece of a character
        text = bytes(BYTE_OF[c] for c in spelt).decode(errors="surrogateescape")
    pieces = []  # [what shows, its columns]: a character with the marks on it, or a stand-in
    for c in text:
        if "\udc80" <= c <= "\udcff":  # a byte that is no whole character (surrogateescape's)
            pieces.append([f"<0x{ord(c) - 0xDC00:02X}>", 6])
        elif unicodedata.category(c) in ("Mn", "Me"):  # a mark: on the one before, or on ◌
            glyphs, n = pieces.pop() if pieces else ["◌", 1]
            pieces.append([glyphs + c, max(n, 2 if c == "\ufe0f" else 1)])
        elif not c.isprintable() and c not in " \n":
            pieces.append([f"U+{ord(c):04X}", len(f"U+{ord(c):04X}")])
        else:  # (U+FE0F above: the emoji form, two columns wide)
            wide = unicodedata.east_asian_width(c) in ("W", "F")
            pieces.append([{" ": "·", "\n": "↵"}.get(c, c), 2 if wide else 1])
    room = width if sum(n for _, n in pieces) <= width else width - 1  # a cut one ends with …
    kept, used = "", 0
    for piece, n in pieces:
        if used + n > room:
            break
        kept, used = kept + piece, used + n
    if room < width:
        kept, used = kept + "…", used + 1
    return kept + " " * (width - used)

def shade(p, colour):  # a probability -> a glyph, or a 256-colour grey background and its text
    level = min(int(p * 8), 7)
    if colour:  # (a cell's text then goes on in this colour, until "\x1b[0m")
        return f"\x1b[48;5;{233 + 3 * level};38;5;{232 if level > 3 else 255}m "
    return SHADES[level]

def lens_picture(top, p, written, inputs, colour=False, screen=80, number=1):
    """The logit lens as lines of text, in panels of as many columns as fit screen: a row per
    block, the last on top; a cell per answer token (numbered from number): the block's likeliest
    token, shaded by the probability it gave the token written, ✓ where it is that token; under
    them, the token each column read. top, p: logit_lens()'s, as lists."""
    label, reset = len(f"block {N_LAYERS}") + 1, "\x1b[0m" if colour else ""
    per = max(1, (screen - label) // (CELL + 3))                      # columns in a panel
    lines = []
    for c0 in range(0, len(written), per):
        cols = range(c0, min(c0 + per, len(written)))
        if c0:
            lines.append("")  # between panels
        numbers = "".join(f" {number + j:<{CELL + 2}}" for j in cols)  # the answer's tokens
        lines.append(f"{'token':<{label}}{numbers}".rstrip())
        for b in reversed(range(N_LAYERS)):
            lines.append(f"{f'block {b + 1}':<{label}}" + " ".join(
                shade(p[b][j], colour) + cell_text(top[b][j])
                + ("✓" if top[b][j] == written[j] else " ") + reset for j in cols))
        lines.append(f"{'read':<{label}}" + " ".join(f" {cell_text(inputs[j])} " for j in cols))
    return lines

def answer_forming(prompt_ids, generated, cache, start, columns=64, greedy=True, chunk=CHUNK):
    """--explain, after the answer: the logit lens over its last `columns` tokens (0: all),
    drawn. cache: as it was at start, before the prompt; generated: the answer's ids; greedy:
    chosen at temperature 0 (then a near-tie this pass breaks the other way is named); chunk:
    logit_lens()'s. Ctrl-C: a line says the picture stopped, and the KeyboardInterrupt goes on."""
    if not generated:
        print("the answer forming: no token was written (the first was an end-of-sequence id)")
        return
    n = min(columns or len(generated), len(generated))               # the columns drawn
    skipped, token_ids = len(generated) - n, prompt_ids + generated[:-1]  # (the last: unread)
    print("the answer forming: each block's likeliest next token, had the model ended there\n"
          f"(the logit lens, nostalgebraist 2020; it costs a pass over {len(token_ids)} positions, "
          f"as a\nprefill's, and {N_LAYERS} x {n} LM heads, "
          f"{N_LAYERS * n * D * len(W['lm_head.weight']):.1e} multiply-adds more)", flush=True)
    if skipped:
        print(f"[the answer's last {n} tokens of {len(generated)}; --lens-tokens 0: all of them]")
    routes = [] if MOE else None  # a mixture of experts: their choices, from the same pass
    try:
        top, p, p_top = (a.tolist() for a in logit_lens(
            token_ids, generated[skipped:], cache, start, chunk, True, routes))
    except KeyboardInterrupt:
        print("[the answer forming: stopped]", flush=True)
        raise
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR") and os.environ.get(
        "TERM") != "dumb"  # else a glyph
    ramp = "".join(shade(i / 8, colour) for i in range(8)) + ("\x1b[0m" if colour else "")
    print(f"{ramp} how likely the block found the token written (<1/8..7/8+); ✓ that token")
    print("\n".join(lens_picture(top, p, generated[skipped:], token_ids[len(token_ids) - n:],
                                 colour, shutil.get_terminal_size().columns, skipped + 1)))
    dtype = str(W["model.norm.weight"].dtype).split(".")[-1]
    for j in range(n):  # greedy: the top row is the answer, but where this pass breaks a tie
        if greedy and top[-1][j] != generated[skipped + j]:
            print(f"[note: token {skipped + j + 1}: the top row's {p_top[-1][j]:.4f} against "
                  f"{p[-1][j]:.4f} for the token written, a near-tie this pass, summing in "
                  f"another order in {dtype}, broke the other way]")
    if routes:
        last = len(prompt_ids) - 1  # the prompt's last token: it chose the first token written
        print("\n".join(experts_at_work(routes, last, range(last, len(token_ids)))))

# ─── The experts at work ───

def experts_at_work(routes, last, answer):
    """A mixture of experts: in each MoE block, the experts the token at row last chose, by
    weight; then over the rows of answer (a range), how many of the E experts each block used,
    and its busiest three with their share of the choices; experts from disk, the share of its
    picks its pool held (the answer's passes and the lens's). routes: logit_lens()'s, (block,
    chosen (C, k), mix (C, k)) chunk after chunk -> lines, none over 80 columns."""
    per_block = {}
    for b, chosen, mix in routes:
        per_block.setdefault(b, []).append((chosen, mix))
    top_k, e = MOE["num_experts_per_tok"], MOE["num_experts"]
    lines = [f"the experts at work: in each block, the {top_k} of {e} experts the prompt's last",
             "token chose (#expert:weight); then over the answer, how many experts each block",
             f"used, and its busiest three with their share of the {top_k} x {len(answer)} choices"]
    used = []
    for b, parts in per_block.items():
        chosen = mx.concatenate([c for c, _ in parts]).tolist()       # a row of k each position
        mix = mx.concatenate([w for _, w in parts]).tolist()
        picks = [f"#{x}:{100 * w:.0f}%" for w, x in sorted(zip(mix[last], chosen[last]),
                                                          reverse=True)]
        for i, wrapped in enumerate(textwrap.wrap(" ".join(picks), 71)):  # k > 8: more lines
            lines.append(f"{f'block {b + 1}' if i == 0 else '':<8} {wrapped}")
        tally = Counter(x for row in chosen[answer.start:answer.stop] for x in row)
        busiest = "".join(f"  #{x} {100 * n / (top_k * len(answer)):.0f}%"
                          for x, n in tally.most_common(3))
        used.append(f"{f'block {b + 1}':<8} {len(tally):>4} of {e} used; busiest{busiest}")
        pool = POOLS.get(f"model.layers.{b}.mlp.")
        if pool:  # experts from disk: how often its pool held what was picked
            used[-1] += f"; held {pool.counts['found'] / max(pool.counts['wanted'], 1):.0%}"
    return lines + used

# ─── What memory moves ───

def bandwidth(size=2**28, tries=5):
    """This machine's memory speed for what bounds decoding, bytes a second: reading size bytes
    already written and resident (summing their 32-bit words: integer work, light enough that the
    reading takes the time, with no page faults timed), the best of tries. MLX's CPU runs each
    operation on one core, so there each core reads its part at once, on a stream of its own; a
    GPU reads them all with one operation."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    streams = cpu_streams(n) if mx.default_device() == mx.cpu else [mx.default_stream(
        mx.default_device())]
    words = mx.zeros(size // 4, mx.uint32)                            # written before any timing
    slices = mx.split(words, [len(words) * i // len(streams) for i in range(1, len(streams))])
    mx.eval(slices)

    def sum_slices():
        mx.eval([piece.sum(stream=stream) for piece, stream in zip(slices, streams)])
    return size / min(timeit.repeat(sum_slices, timer=time.perf_counter, number=1, repeat=tries))

@lru_cache
def cpu_streams(n):  # n CPU streams, made once: MLX keeps a thread for each as long as it runs
    return [mx.new_stream(mx.cpu) for _ in range(n)]

# ═══ Part IV — The program, read top-down from main() ═══
import argparse, errno, re, shlex, signal, socket, threading, warnings  # noqa: E401, E402
from contextlib import contextmanager, redirect_stdout  # noqa: E402
from tokenizers.decoders import DecodeStream  # noqa: E402
from tqdm import tqdm  # noqa: E402 (installed with huggingface_hub, with tokenizers)


# ─── The command line ───

def main(argv=None):
    """The command line: every flag, file and number checked first; then one answer, a batch or a
    chat. Under mlx.launch each process (a rank) runs this, and the launcher's few lines are named
    calls: the ranks agree on the checks, rank 0 alone prints, every rank draws the same seed."""
    group = mx.distributed.init()  # mlx.launch's processes, or this one alone
    args, folder, cfg, texts, prompts = all_ranks_agree(group, setup, argv, group)
    with rank_zero_prints(group):
        if args.seed is None and group.size() > 1:
            args.seed = shared_seed(group)
        if args.seed is not None:
            mx.random.seed(args.seed)
        if not args.quiet:
            print(summary(folder, cfg))
        if prompts is None:
            converse(args)
        elif len(prompts) > 1:
            reply_batch(texts, prompts, args)
        else:
            reply(prompts[0], args, new_cache(args), echo="" if args.chat else texts[0])

def setup(argv, group):
    """main()'s flags, prompts, folder and files, each checked before any output -> args, the
    folder, its config, the prompts' texts and ids (None: a conversation)."""
    if sys.stdout is None:  # closed (>&-): the text would go nowhere, and the exit say success
        raise UserError("standard output is closed (>&-): there is nowhere to write the text")
    args, launched = parse_args(argv), group.size() > 1
    if launched:
        check_launched(args)
    texts = read_prompts(args)
    folder = model_folder(args.model, may_fetch=not launched)
    cfg = load_checked(folder, args.dtype and getattr(mx, args.dtype), group,
                       args.memory and args.memory * 1e9)
    for tag in ("<|im_start|>", "<|im_end|>"):
        if args.chat and len(tokenize(tag)) != 1:  # a tokenizer without them spells them out
            raise UserError(f"{folder / 'tokenizer.json'} has no {tag} token: --chat needs "
                            "the chat tokens of Qwen3's instruct models")
    if args.chat and args.think is None:  # neither --think nor --no-think: the template's way
        args.think = thinks_first(folder)
    if args.kv_bits and D_HEAD % args.kv_group_size:
        raise UserError(f"--kv-group-size {args.kv_group_size} does not divide the heads' width "
                        f"(head_dim {D_HEAD} in {folder / 'config.json'}): try 32")
    if args.draft == "mtp" and "mtp.fc.weight" not in W:
        raise UserError(f"{folder} has no MTP head (mtp.* tensors): --draft mtp needs Qwen3.5's "
                        "own; --draft lookup drafts with any model")
    prompts = None  # --chat without a prompt: a conversation
    if texts[0] is not None or not args.chat:  # each prompt checked before any output
        texts = [text or "The capital of France is" for text in texts]
        prompts = [tokenize(chat_prompt([t], args.system, args.think)) if args.chat
                   else tokenize(t) for t in texts]
        longest = max(len(ids) for ids in prompts)
        if longest >= MAX_POS:
            raise UserError(f"a prompt is {longest} tokens; the context holds {MAX_POS}")
    return args, folder, cfg, texts, prompts

def as_text(data, source="standard input"):
    """Bytes (standard input, or a flag given as bytes) -> text; not UTF-8: a UserError."""
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise UserError(f"{source} is not UTF-8 text ({e.reason} at byte {e.start})") from None

class Flags(argparse.ArgumentParser):
    def error(self, message):  # argparse's own: its usage, then exit 2; ours: one line
        raise UserError(f"{message} (see --help)")

def parse_args(argv):
    """The flags (mlx_lm.generate's names where it has the flag); every value checked first."""
    ap = Flags(description="Qwen3 text generation from scratch with MLX.",
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = ap.add_argument
    add("--model", default=str(HERE / "Qwen3-0.6B"), help="a folder, or a Hugging Face repo id")
    add("--prompt", "-p", action="append", help='"-" reads stdin; given again: a batch '
        '(none: "The capital of France is")')
    add("--prompts", metavar="FILE", help="one prompt a line, decoded as a batch")
    add("--batch-size", type=int, default=8, metavar="N", help="most rows decoded at once")
    add("--max-tokens", "-m", type=int, default=100, help="most tokens generated")
    add("--temperature", "--temp", type=float, default=0.0, help="0: greedy")
    add("--top-p", type=float, default=1.0, help="sample from this much probability")
    add("--top-k", type=int, default=0, help="sample from the K likeliest (0: all)")
    add("--min-p", type=float, default=0.0, help="none under this x the likeliest's")
    add("--seed", type=int, help="makes sampling reproducible")
    add("--draft", choices=["mtp", "lookup"], help="draft with Qwen3.5's MTP head, or by lookup")
    add("--num-draft-tokens", type=int, metavar="K", help="drafted at a time (mtp: 1, lookup: 3)")
    add("--chat", action="store_true", help="chat template; without --prompt: a chat")
    add("--system", help="system message, with --chat")
    thinking = ap.add_mutually_exclusive_group()  # (argparse says when both are given)
    thinking.add_argument("--think", dest="think", action="store_const", const=True,
                          help="thinking on, with --chat (neither flag: as its template says)")
    thinking.add_argument("--no-think", dest="think", action="store_const", const=False,
                          help="thinking off, with --chat")
    add("--dtype", choices=["bfloat16", "float16", "float32"], help="none: the weights' own")
    add("--kv-bits", type=int, choices=[2, 3, 4, 5, 6, 8], help="the KV cache in this many bits, "
        "as the weights are quantised (none: the model's dtype)")
    add("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
        help="--kv-bits: the numbers of a head's width that share a scale and a bias")
    add("--quantized-kv-start", type=int, default=5000, metavar="N",
        help="--kv-bits: the positions the cache holds before it goes into bits")
    add("--memory", type=float, metavar="GB", help="the most the weights may hold; a mixture's "
        "experts beyond it are read from disk when picked (none: what this machine can hold)")
    add("--show-probs", type=int, default=0, metavar="K", help="the K likeliest next tokens")
    add("--explain", action="store_true", help="the steps inside (chat: each turn's)")
    add("--lens-tokens", type=int, metavar="N", default=argparse.SUPPRESS,  # (given, or 64)
        help="--explain's picture: the answer's last N tokens (0: all) (default: 64)")
    add("--quiet", "-q", action="store_true", help="print the completion only")
    add("--verbose", action="store_true", help="a chat at a terminal: each answer's statistics")
    args = ap.parse_args(argv)
    lens_given = "lens_tokens" in args  # (argparse sets no default: one given is known)
    args.lens_tokens = getattr(args, "lens_tokens", 64)
    checks = [(args.max_tokens < 1, "--max-tokens must be at least 1"),
              (not args.temperature >= 0, "--temperature must be 0 or more"),
              (not 0 < args.top_p <= 1, "--top-p must be more than 0 and at most 1"),
              (args.top_k < 0, "--top-k must be 0 or more"),
              (not 0 <= args.min_p <= 1, "--min-p must be from 0 to 1"),
              (args.show_probs < 0, "--show-probs must be 0 or more"),
              (lens_given and not args.explain, "--lens-tokens needs --explain"),
              (args.lens_tokens < 0, "--lens-tokens must be 0 or more"),
              (args.batch_size < 1, "--batch-size must be at least 1"),
              (args.num_draft_tokens is not None and not args.draft,
               "--num-draft-tokens needs --draft"),
              (args.num_draft_tokens is not None and args.num_draft_tokens < 1,
               "--num-draft-tokens must be at least 1"),
              (args.draft == "mtp" and args.num_draft_tokens not in (None, 1),
               "--draft mtp drafts 1 token at a time (its head predicts one ahead)"),
              (args.system is not None and not args.chat, "--system needs --chat"),
              (args.think is not None and not args.chat,
               f"--{'' if args.think else 'no-'}think needs --chat"),
              (args.quiet and args.verbose, "--quiet and --verbose ask for opposites"),
              (args.seed is not None and not 0 <= args.seed < 2**64,
               "--seed must be from 0 to 2**64 - 1"),
              (args.memory is not None and not args.memory > 0, "--memory must be more than 0"),
              (args.quantized_kv_start < 0, "--quantized-kv-start must be 0 or more")]
    for wrong, message in checks:
        if wrong:
            ap.error(message)
    if args.draft and args.num_draft_tokens is None:
        args.num_draft_tokens = 1 if args.draft == "mtp" else 3
    return args

def read_prompts(args):
    """Each --prompt's text ("-": stdin's), then --prompts FILE's lines, checked; [None]: none."""
    if sys.stdin is None:  # closed (<&-)
        if "-" in (args.prompt or []) or args.chat and not args.prompt and not args.prompts:
            raise UserError("standard input is closed (<&-), and the prompt is read from it")
        # A file opened next would get descriptor 0, which MLX's safetensors reader takes for a
        # failure: it is filled first.
        os.open(os.devnull, os.O_RDONLY)
    texts = [as_text(sys.stdin.buffer.read()) if t == "-" else t for t in args.prompt or []]
    for flag, text in [("--prompt", text) for text in texts] + [("--system", args.system)]:
        if text is not None:  # bytes that are not UTF-8 reach Python as lone surrogates
            as_text(text.encode(errors="surrogateescape"), flag)
    if "" in texts:
        raise UserError("the prompt is empty (see --help)")
    if args.prompts is not None:
        if not os.path.lexists(args.prompts):  # (read_file() would name its folder first)
            raise UserError(f"{args.prompts} does not exist (--prompts takes a file, one prompt a "
                            "line)")
        lines = read_file(Path(args.prompts)).splitlines()
        texts += [as_text(line, args.prompts) for line in lines if line.strip()]
        if not lines or not texts:
            raise UserError(f"{args.prompts} has no prompt (one a line)")
    if len(texts) > 1 and (args.explain or args.show_probs):
        raise UserError("--explain and --show-probs show one prompt: give one (see --help)")
    if len(texts) > 1 and args.draft:
        raise UserError("--draft decodes one prompt at a time: give one (see --help)")
    return texts or [None]

def summary(folder, cfg):
    """The model's line: what runs, its layers, heads and size, the dtype it computes in."""
    tensors, quant = {id(w): w for w in W.values()}.values(), cfg["quantization"]  # tied: once
    pooled = {id(W[name]): MOE["num_experts"] / pool.size for pool in POOLS.values()
              for name in pool.spans}  # experts from disk: a pool's slots hold S of E
    size = f"{sum(w.size * pooled.get(id(w), 1) for w in tensors) / 1e9:.2f}B parameters"
    if quant:  # packed words: the format and the bytes, not the count
        size = (f"{quant['bits']}-bit, groups of {quant['group_size']}: "
                f"{sum(w.nbytes * pooled.get(id(w), 1) for w in tensors) / 1e9:.2f} GB")
    if cfg["group"]:  # what this process holds
        size += f" on rank 0 of {cfg['group'].size()} (each 1/{cfg['group'].size()} of a block)"
    name, layers = f"Qwen3 from {folder}", f"{N_LAYERS} layers"
    if MODEL == "qwen3_5":  # and what of it is not run
        mtp = "an MTP head to draft with" if "mtp.fc.weight" in W else "no MTP head"
        name = f"Qwen3.5 from {folder} (text only: its vision tower is not run; {mtp})"
        layers += f", {QWEN35['layer_types'].count('linear_attention')} of them Gated DeltaNet"
    if MOE:  # (Qwen3-MoE from, Qwen3.5-MoE from)
        name = name.replace(" from ", "-MoE from ", 1)
        layers += (f", {len(MOE['layers'])} with {MOE['num_experts']} experts "
                   f"({MOE['num_experts_per_tok']} a token)")
        size += f", {cfg['load_peak'] / 1e9:.2f} GB at most while loading"  # never two models
    if POOLS:  # experts from disk
        slots = sum(W[name].nbytes for pool in POOLS.values() for name in pool.spans)
        size += (f"; experts from disk: {next(iter(POOLS.values())).size} of "
                 f"{MOE['num_experts']} a block in memory ({slots / 1e9:.2f} GB)")
    if YARN:
        size += f", RoPE by YaRN x{YARN['factor']} to {MAX_POS} positions"
    return (f"{name}: {layers}, hidden {D}, {N_HEADS} query / {N_KV} KV heads x {D_HEAD}, "
            f"{size}, {str(W['model.norm.weight'].dtype).split('.')[-1]}")  # bfloat16, say

# ─── One answer, and its statistics ───

def reply(prompt_ids, args, cache, start=0, echo="", keep=None, generated=None, chunk=CHUNK):
    """One completion: the prompt read in, --explain or --show-probs, then the text as it comes
    (after echo) and the statistics (--quiet: the text alone) -> generated, the new ids, each
    added as it is printed. keep: (position, list): the list is given the cache as it is at that
    position of the prompt; chunk: the prompt's passes' (prefill()'s, and --draft's)."""
    prompt_end = start + len(prompt_ids)
    if prompt_end >= MAX_POS:
        raise UserError(f"the prompt is {prompt_end} tokens; the context holds {MAX_POS}")
    if prompt_end + args.max_tokens > MAX_POS:
        note(f"generation stops at the context limit, {MAX_POS} tokens")
    mx.reset_peak_memory()  # each answer's peak its own (a chat's earlier turns, --explain's)
    blocks = [] if args.explain else None  # x after each block, for --explain
    before = copy.copy(cache)  # as it is at start, for --explain's pass (the run writes cache)
    counts, tic = {}, time.perf_counter()  # counts: what --draft drafted, accepted, passes
    logits, hidden = read_prompt(prompt_ids, args.draft, cache, start, keep, blocks, chunk)
    if args.explain or args.show_probs:  # their own time is kept off the prompt's clock
        tic += views_before(prompt_ids, args, blocks, logits, cache, start)
    if not mx.isfinite(logits).all().item():  # NaN or inf: said before any text is printed
        raise not_finite("after the prompt", logits.dtype)
    print("" if args.quiet else "=" * 10 + "\n" + echo, end="", flush=True)
    generated, t_first, sampler = [] if generated is None else generated, None, sampler_of(args)
    if args.draft:
        drafter = MTPDrafter(start, chunk, cache) if args.draft == "mtp" else PromptLookup(
            args.num_draft_tokens)
        tokens = generate_draft(prompt_ids, args.max_tokens, sampler, drafter, cache, start,
                                hidden, counts)
    else:
        tokens = generate(prompt_ids, args.max_tokens, sampler, cache, start, logits)
    for token, piece in stream_text(tokens):
        if t_first is None:  # the first token ends the prefill; the generation's clock starts
            t_first = time.perf_counter()
            for pool in POOLS.values():  # (experts from disk: what the generation reads)
                pool.counts = dict.fromkeys(pool.counts, 0)
        generated.append(token)
        print(piece, end="", flush=True)
    if args.quiet:
        print(flush=True)
    else:
        stats_after(args, len(prompt_ids), generated, tic, t_first or time.perf_counter(), cache,
                    prompt_end, counts)
    if args.explain:  # after the statistics: their times are the answer's alone
        try:
            answer_forming(prompt_ids, generated, before, start, args.lens_tokens,
                           args.temperature == 0, chunk)
        except KeyboardInterrupt:
            if not args.chat:  # a plain run ends at Ctrl-C; a chat keeps the answer and cache
                raise
    return generated

def new_cache(args):  # an empty KV cache, an entry a layer: in bits with --kv-bits (Part II)
    if args.kv_bits is None:
        return [None] * N_LAYERS
    return KVCache([None] * N_LAYERS, args.kv_bits, args.kv_group_size, args.quantized_kv_start)

def note(text):  # a line on stderr, said once (several processes: by rank 0)
    if GROUP is None or GROUP.rank() == 0:
        print(f"[note: {text}]", file=sys.stderr)

def read_prompt(prompt_ids, draft, cache, start, keep, blocks, chunk):
    """The prompt through the model into cache (reply()'s keep, blocks, chunk) -> its last
    logits (vocab,), and with --draft every token's hidden state (L, D) (else None)."""
    mark, saved = keep or (start, None)  # the prompt in two parts, the cache kept between
    earlier, rest = prompt_ids[:mark - start], prompt_ids[mark - start:]
    hidden = hidden_pass(earlier, cache, start, chunk=chunk) if draft and earlier else None
    if earlier and not draft:
        prefill(earlier, cache, start, chunk=chunk)                   # its logits never computed
    # Kept at the mark: a DeltaNet state is a new array at every token; the KV buffers are
    # written over after the mark, before anything reads them.
    if saved is not None:
        mx.eval(cache)
        saved[:] = list(cache)
    if not draft:
        return prefill(rest, cache, mark, blocks, chunk), None        # (vocab,)
    more = hidden_pass(rest, cache, mark, blocks, chunk)              # (L, 1024) every token's
    hidden = more if hidden is None else mx.concatenate([hidden, more])
    return linear(hidden[-1:], "lm_head")[-1], hidden                 # (vocab,), (L, 1024)

def views_before(prompt_ids, args, blocks, logits, cache, start):
    """--explain's views of the prompt, or --show-probs's next tokens -> the seconds they took."""
    mx.eval(logits)
    paused = time.perf_counter()
    if args.explain:
        explain(prompt_ids, blocks, logits, cache, start, args.show_probs or 5)
    else:
        print_top(logits, args.show_probs)
    return time.perf_counter() - paused

def sampler_of(args):  # the sampling flags -> Step 8's sample() with them fixed
    return partial(sample, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                   min_p=args.min_p)

def stream_text(token_ids):
    """Yield (id, the text it adds). A character split over two tokens (emoji, CJK) comes whole."""
    stream = DecodeStream(skip_special_tokens=False)
    for token in token_ids:
        yield token, stream.step(TOK, token) or ""

def stats_after(args, n_prompt, generated, tic, t_first, cache, prompt_end, counts):
    """After the text: mlx-lm's statistics and ours (print_stats()), then with --explain what
    memory moves, with --draft what drafting did."""
    rate = print_stats(n_prompt, len(generated), tic, t_first, cache, prompt_end,
                       counts.get("passes"), args.draft == "mtp")
    if args.explain:  # the limit decoding works against: what memory moves
        speed = bandwidth()
        print(f"Memory: this machine reads {speed / 1e9:.1f} GB/s (268 MB already in memory, "
              f"the best of 5): decoding read {100 * rate / speed:.1f}% of it", flush=True)
    if args.draft:  # after mlx-lm's lines: what drafting did
        by = "the MTP head" if args.draft == "mtp" else "prompt lookup"
        share = f" ({counts['accepted'] / counts['drafted']:.0%})" if counts["drafted"] else ""
        print(f"Draft: {counts['drafted']} tokens drafted by {by}, {counts['accepted']} accepted"
              f"{share}: {len(generated)} tokens in {counts['passes']} passes of the model",
              flush=True)

def print_stats(n_prompt, n, tic, t_first, cache, prompt_end, passes=None, mtp=False):
    """mlx_lm.generate's lines, counted as it counts (the prompt's rate: to the first token; the
    generation's: n tokens over the time since the first), then the KV cache's and the bytes a
    pass of the model reads -> the bytes a second decoding read. prompt_end: the positions the
    cache held after the prompt; passes: the model's, when drafting made fewer than n (None: one
    a token); mtp: the MTP head drafted, reading its own."""
    rate = n / max(time.perf_counter() - t_first, 1e-9)              # tokens a second
    print(f"\n{'=' * 10}\nPrompt: {n_prompt} tokens, {n_prompt / (t_first - tic):.3f} "
          "tokens-per-sec")
    print(f"Generation: {n} tokens, {rate:.3f} tokens-per-sec")
    peaks = peak_memory()  # (several processes: each rank's)
    print("Peak memory: " + ", ".join(f"{peak / 1e9:.3f} GB" + (f" (rank {r})" if GROUP else "")
                                      for r, peak in enumerate(peaks)))
    held = prompt_end + n  # the positions the cache holds now
    bits = ""
    if isinstance(cache, KVCache):  # (its bits from quantized_start on)
        bits = (f" in {cache.bits} bits, groups of {cache.group_size}" if any(
            isinstance(entry, Quantized) for entry in cache) else
            f" (in {cache.bits} bits from position {cache.quantized_start})")
    print(f"KV cache: {held} positions{bits}, {cache_bytes(cache, held) / 1e6:.3f} MB "
          f"({cache_bytes(cache) / 1e6:.3f} MB allocated)")
    if POOLS:  # experts from disk: what the pools held, found and read
        print_pools(n, time.perf_counter() - t_first)
    if MODEL == "qwen3_5":  # the other memory
        print(f"DeltaNet state: {QWEN35['layer_types'].count('linear_attention')} layers, "
              f"{cache_bytes(cache, kind='linear_attention') / 1e6:.3f} MB at any length")
    weight_bytes, kv_bytes = token_bytes(cache, held, mtp)
    per_pass = n / passes if passes else 1.0                          # tokens a pass
    per_token = (weight_bytes + kv_bytes) / per_pass                  # bytes a token
    drafted = "" if passes is None else f" a pass, {per_pass:.2f} tokens a pass: " \
        f"{per_token / 1e6:.3f} MB a token"
    print(f"Bytes per token{'' if GROUP is None else ', rank 0'}: {weight_bytes / 1e6:.3f} MB of "
          f"weights + {kv_bytes / 1e6:.3f} MB of cache{drafted}, {per_token * rate / 1e9:.3f} "
          f"GB/s at {rate:.3f} tokens-per-sec", flush=True)
    if GROUP is not None:  # what joining the processes' parts costs a pass
        x = mx.zeros((1, D), W["model.norm.weight"].dtype)            # a block's output, a token
        sums = 2 * (N_LAYERS + mtp)  # (the MTP head's layer: 2 more)
        seconds = all_sum_seconds(sums, x)
        print(f"All-sums: {sums} a pass (2 a block) over {GROUP.size()} processes, "
              f"{x.nbytes / 1e3:.3f} kB each; timed alone, {seconds * 1e3:.3f} ms a pass: "
              f"{100 * seconds * rate / per_pass:.1f}% of its time", flush=True)
    return per_token * rate

def print_pools(n, seconds):
    """Experts from disk, over the n tokens of an answer, from its first token on (seconds): the
    share of the picks (a block's experts a pass) the pools held, the bytes read a token and the
    disk's speed (bytes over the time a read was under way), the time a token those predict
    (computing, the time outside the pools, plus bytes over speed: the rule of thumb) beside
    the time it took (the rest: the pools' time with no read under way), and this process's most
    resident memory since it started (the operating system's count: MLX's buffers, Python, the
    reads')."""
    total = {key: sum(pool.counts[key] for pool in POOLS.values()) for key in POOLS_COUNTED}
    found, each = total["found"] / max(total["wanted"], 1), 1e3 / max(n, 1)  # (ms a token)
    speed = total["bytes"] / total["disk"] if total["disk"] else 0.0  # the disk's, here
    computing = (seconds - total["seconds"]) * each
    print(f"Experts from disk: {found:.1%} of the picks found in memory; "
          f"{total['bytes'] * each / 1e9:.2f} MB read a token at {speed / 1e9:.2f} GB/s; a token "
          f"took {seconds * each:.1f} ms, where {computing:.1f} computing + the MB ÷ the GB/s "
          f"predict {computing + total['disk'] * each:.1f} (the rest: the pools' time with no read "
          f"under way, writing into the slots); the process: {resident_peak() / 1e9:.3f} GB "
          f"resident at most (since it started)")

def resident_peak():  # this process's most resident memory so far, bytes
    import resource  # (Unix's; MLX runs on no other)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # (a Mac counts bytes, Linux KB)

def token_bytes(cache, held, mtp=False, rows=1):
    """What a pass of the model over one token reads -> (its weights' bytes, its cache's): each
    weight it uses once (the embedding's one row left out, a tied table counted once as the LM
    head; a mixture's experts, the k of E chosen), the keys and values of held positions, a
    DeltaNet's notes whole. mtp: and the MTP head's drafting, its own weights and the LM head
    again (not its small cache). rows: a batch's, each one's share of a read of the weights
    (of the experts, each row's own k at most: rows may choose the same)."""
    mtp_names = ("mtp.", f"model.layers.{N_LAYERS}.")  # the MTP head's (its layer: both names)
    skipped = ("model.embed_tokens", *mtp_names)
    used = {id(w): w for name, w in W.items() if not name.startswith(skipped)}  # tied: once
    drafting = {id(w): w for name, w in W.items() if name.startswith(mtp_names)} if mtp else {}
    head_tensors = [w for name, w in W.items() if name.startswith("lm_head.")] if mtp else []
    share = {id(w): min(MOE["num_experts"], rows * MOE["num_experts_per_tok"]) / len(w)  # k a
             for name, w in W.items() if ".mlp.experts." in name}  # row, of (E or a pool's S, ..)
    read_once = [*used.values(), *drafting.values(), *head_tensors]
    weight_bytes = sum(w.nbytes * share.get(id(w), 1) for w in read_once) / rows
    return weight_bytes, cache_bytes(cache, held) + cache_bytes(cache, kind="linear_attention")

def cache_bytes(cache, held=None, kind="full_attention"):
    """The keys' and values' bytes of positions 0..held-1 (or all the buffers hold);
    kind="linear_attention": Qwen3.5's DeltaNet states, the same size at any length."""
    notes = kind == "linear_attention"
    layers = [c for i, c in enumerate(cache) if c is not None and deltanet(i) == notes]
    if notes:
        return sum(a.nbytes for c in layers for a in c)
    return sum(a.nbytes for entry in layers for a in kv_arrays(cut_at(entry, held)))

# ─── A batch ───

def reply_batch(texts, prompts, args):
    """Several prompts (their texts and ids), one continuous batch (generate_batch()): each
    completion after its prompt, in the prompts' order (--quiet: the completions alone); at a
    terminal, a progress line meanwhile; then the batch's statistics."""
    if max(len(ids) for ids in prompts) + args.max_tokens > MAX_POS:
        note(f"generation stops at the context limit, {MAX_POS} tokens")
    mx.reset_peak_memory()  # the batch's own peak
    for pool in POOLS.values():  # (experts from disk: what the batch reads)
        pool.counts = dict.fromkeys(pool.counts, 0)
    tic, done, ended, cache = time.perf_counter(), [[] for _ in prompts], [], new_cache(args)
    tokens = generate_batch(prompts, args.max_tokens, sampler_of(args), args.batch_size, ended,
                            cache)
    # At a terminal, a progress line meanwhile, taken away on every way out (leave=False).
    with tqdm(total=len(prompts), file=sys.stderr, disable=not sys.stderr.isatty(), leave=False,
              bar_format="[{n} of {total} prompts done, {postfix}]", postfix="0 tokens") as bar:
        for n, (i, token) in enumerate(tokens, 1):
            done[i].append(token)
            if n % 8 == 0:
                bar.set_postfix_str(f"{n} tokens", refresh=False)
                bar.update(len(ended) - bar.n)
    seconds = time.perf_counter() - tic
    for text, ids in zip(texts, done):
        completion = "".join(piece for _, piece in stream_text(ids))  # as a single run prints it
        print(completion if args.quiet else "=" * 10 + "\n" + (f">> {text}\n" if args.chat else
                                                              text) + completion)
    if args.quiet:
        return
    n, kv_positions = sum(len(ids) for ids in done), sum(end[1] for end in ended)
    full = N_LAYERS - sum(deltanet(i) for i in range(N_LAYERS))  # its layers with keys and values
    kv_heads = N_KV // (GROUP.size() if GROUP else 1)  # (several processes: rank 0's)
    size = W["model.norm.weight"].dtype.size  # a number's bytes in the cache
    # A batch turns to bits when its longest row passes the start: those ended before, not.
    packed = [positions for _, positions, in_bits in ended if in_bits]  # each one's positions
    bits = args.kv_bits / 8 + 2 * size / args.kv_group_size if packed else 0  # a number's bytes
    said = f", {len(packed)} of them in {args.kv_bits} bits" if packed else ""
    kv = (kv_positions * size + sum(packed) * (bits - size)) * full * 2 * kv_heads * D_HEAD
    rows = min(args.batch_size, len(prompts))  # a token of each row shares one read of the weights
    print(f"{'=' * 10}\nPrompt: {sum(len(ids) for ids in prompts)} tokens, {len(prompts)} prompts, "
          f"--batch-size {args.batch_size}")
    print(f"Generation: {n} tokens, {n / seconds:.3f} tokens-per-sec (all rows, prefills included)")
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    if POOLS:  # experts from disk: over the whole batch, its prefills too
        print_pools(n, seconds)
    print(f"KV cache: {kv_positions} positions in {len(ended)} sequences{said}, {kv / 1e6:.3f} MB "
          "(each as it ended; at most --batch-size of them held at once)")
    weight_bytes = token_bytes([], 0, rows=rows)[0]  # (a mixture's: at most: rows share experts)
    print(f"Bytes per token, a row of {rows}: {'at most ' if MOE else ''}"
          f"{weight_bytes / 1e6:.3f} MB of weights + {kv / len(ended) / 1e6:.3f} MB of keys and "
          "values (their mean at the end)", flush=True)

# ─── Chat ───

STEP = 32  # tokens a chat at a terminal prefills between chances for Ctrl-C (chat_turns())

@contextmanager
def interruptible():
    """Inside: Ctrl-C raises KeyboardInterrupt (Python's own handler), for the code to tidy up or
    stop an answer; after, on every way out: the caller's handler again. Off the main thread,
    where Python sets no handler (Ctrl-C reaches the main thread alone): nothing is changed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)

def converse(args):
    """--chat without --prompt: a conversation, one turn per line, the KV cache kept between turns:
    each turn computes only what its prompt does not share with what the cache holds. At a
    terminal: line editing and history (readline), the answers alone unless --verbose, and Ctrl-C
    stops an answer, keeping the conversation (that answer as far as it came) and its cache."""
    at_terminal = sys.stdin.isatty()
    if at_terminal:  # a person types: say how to end; answers as quiet as mlx_lm.chat's
        import readline  # noqa: F401 (input() edits the line and keeps a history with it)
        print("Type a message and press Enter; an empty line or Ctrl-D ends the chat; Ctrl-C "
              "stops an answer.", file=sys.stderr)
        quieter = argparse.Namespace(**{**vars(args), "quiet": args.quiet or not args.verbose})
        with interruptible():  # the caller's Ctrl-C handler back when the chat ends
            return chat_turns(quieter, at_terminal)
    chat_turns(args, at_terminal)

def chat_turns(args, at_terminal):
    """converse()'s turns, each line read until an empty one, Ctrl-D or the input's end. At a
    terminal the prompt goes through the model STEP tokens at a time (--draft's passes too): MLX
    computes a step whole, so Ctrl-C takes effect after at most one (a CHUNK's wait would be
    seconds; through a pipe, CHUNK it is)."""
    turns, cache, cached_ids, saved, mark = [], new_cache(args), [], None, 0
    think = args.think is not False  # (main() has read the template's way into it)
    while True:
        try:  # a line typed at the ">> " prompt, or read from a pipe
            line = input(">> ") if at_terminal else as_text(sys.stdin.buffer.readline())
        except EOFError:  # Ctrl-D: the chat ends, on a new line
            print()
            return
        turns.append(line.rstrip("\r\n"))
        if not turns[-1]:  # an empty line, or the end of the input
            return
        prompt_ids = tokenize(chat_prompt(turns, args.system, think))
        reused = shared_positions(cached_ids, prompt_ids)
        if MODEL == "qwen3_5" and reused < len(cached_ids):
            # A DeltaNet's notes cannot be cut back: go on from the ones kept at the mark.
            reused = mark if saved and mark <= reused else 0
            cache[:] = saved if reused else [None] * N_LAYERS
        if not args.quiet:
            print(f"[KV cache: {reused} tokens reused, {len(prompt_ids) - reused} new to prefill]")
        # The next turn's prompt renders this answer without its thinking, so it parts from this
        # one right after "<|im_start|>assistant\n": Qwen3.5's cache is kept as it is there.
        mark = len(prompt_ids) - len(tokenize(chat_prompt([""], None, think)
                                              .split("<|im_start|>assistant\n")[-1]))
        saved, generated = [] if MODEL == "qwen3_5" and mark > reused else None, []
        try:
            reply(prompt_ids[reused:], args, cache, reused, keep=None if saved is None else
                  (mark, saved), generated=generated, chunk=STEP if at_terminal else CHUNK)
            cached_ids = prompt_ids + generated  # what generate() leaves in the cache
        except KeyboardInterrupt:
            # Ctrl-C: the answer stops. The cache may hold a token more than was printed (Step 9),
            # so it is trusted as far as sure, and -1 (no id) sends a DeltaNet back to the mark.
            print(flush=True)
            cached_ids = (prompt_ids + generated[:-1] if generated else prompt_ids[:reused]) + [-1]
        turns.append(TOK.decode(generated))

def chat_prompt(turns, system=None, think=True):
    """turns: [user, assistant, user, ...] texts, the user's last -> Qwen3's chat prompt. Earlier
    answers lose their <think>...</think> part, as its template drops it. Qwen3.5's also trims each
    text and opens the answer's thinking itself ("<think>\n")."""
    trim = str.strip if MODEL == "qwen3_5" else str  # (str(text) is the text)
    text = f"<|im_start|>system\n{trim(system)}<|im_end|>\n" if system else ""
    for i, turn in enumerate(turns):
        role, turn = ("assistant" if i % 2 else "user"), trim(turn)
        if role == "assistant" and "</think>" in turn:  # keep what follows the thinking
            turn = turn.split("</think>")[-1].lstrip("\n")
        text += f"<|im_start|>{role}\n{turn}<|im_end|>\n"
    thinking = "<think>\n" if MODEL == "qwen3_5" else ""  # off: an empty think block, in both
    return text + "<|im_start|>assistant\n" + (thinking if think else "<think>\n\n</think>\n\n")

def thinks_first(folder):
    """Does the folder's chat template open each answer with thinking unless told not to (Qwen3's,
    Qwen3.5-4B's and larger), or only when enable_thinking is true (Qwen3.5-0.8B's and 2B's)?
    Read from its text, not rendered; a folder with no template: yes."""
    for path in (folder / "chat_template.jinja", folder / "tokenizer_config.json"):
        if path.exists():  # the .jinja file first, as transformers reads them
            return b"enable_thinking is defined and enable_thinking is true" not in read_file(path)
    return True

def shared_positions(cached_ids, prompt_ids):
    """Cached positions a new prompt keeps: the common prefix, short of the prompt's last token."""
    return len(os.path.commonprefix([cached_ids, prompt_ids[:-1]]))  # element by element

# ─── Loading, and the file checks ───

class UserError(SystemExit):
    """The user's flags, files or numbers: Python prints "error: " and the message; exit 1."""
    def __init__(self, message):
        super().__init__(f"error: {message}")

# The default folder, beside the script (the article's is ./Qwen3-0.6B/ from wherever it is
# started), and where it comes from.
HERE, REPO = Path(__file__).resolve().parent, "Qwen/Qwen3-0.6B"

FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "model.safetensors"]
FETCHED = ["*.json", "*.jinja", "*.safetensors"]  # what a repo id gives the Hugging Face cache

def load_checked(model_dir, dtype=None, group=None, memory=None):
    """load() with every file, config entry and tensor checked first (UserError) -> the config.
    group: mx.distributed's, of several processes: this one keeps its part of each block;
    memory: the bytes the weights may hold (None: what this machine can), a mixture's experts
    beyond it read from disk when picked (Part II's experts from disk)."""
    folder = Path(model_dir)
    cfg = read_configs(folder)  # config.json, generation_config.json: CONFIG's entries
    cfg["group"] = group if group is not None and group.size() > 1 else None
    if cfg["group"]:  # before any weight is read
        check_split(cfg, group.size())
    resident = mx.get_active_memory()  # (a model loaded before, still held: not this load's)
    mx.reset_peak_memory()  # the load's own peak: summary() says it for a mixture of experts
    weights = read_weights(folder, cfg, dtype, memory)  # each tensor used, of its right shape
    cfg["load_peak"] = mx.get_peak_memory() - resident
    tok = read_tokenizer(folder, cfg)  # every id a row of the embedding
    if not (folder / "generation_config.json").exists():  # the article's four files: Qwen3's EOS
        cfg["eos_ids"] |= {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")} - {None}
    return use(cfg, weights, tok)

def read_file(path, parse=None, what="a file"):
    """parse(path) (None: its bytes); a file missing, unreadable or broken raises UserError."""
    try:
        open(path, "rb").close()  # missing, a folder, or a file this user may not read?
    except FileNotFoundError:
        if path.is_symlink():  # a Hugging Face cache whose blob was deleted
            raise UserError(f"{path} is a broken link to {os.readlink(path)}: download it again")
        raise UserError(f"{path.parent} lacks {path.name}") from None
    except OSError as e:
        raise UserError(f"{path} cannot be read: {e.strerror.lower()}") from None
    try:
        return path.read_bytes() if parse is None else parse(str(path))
    except Exception as e:  # whatever the parser says of this file, it is not what we need
        raise UserError(f"{path} is not {what} ({e}); for a fresh copy, delete "
                        f"{os.path.realpath(path)} and download it again") from None

def parse_json(path):
    return json.loads(Path(path).read_text())

def shown_json(value, most=60):  # a config value in an error line, cut with "..." if long
    text = json.dumps(value)
    return text if len(text) <= most else text[:most - 4] + " ..."

KINDS = {  # each kind of config value -> what an error line says it must be
    "model": '"qwen3", "qwen3_moe", "qwen3_5" or "qwen3_5_moe" (Qwen3 and Qwen3.5)',
    "count": "a whole number of 1 or more", "even": "an even whole number (RoPE turns pairs)",
    "positive": "a number more than 0", "bool": "true or false",
    "ids": "a token id, a list of them or null", "mtp": "0 or 1 (an MTP head, or none)",
    "quantization": 'MLX\'s affine quantisation (not "mxfp4", "nvfp4" or "mxfp8")',
    "layers": 'a list of "linear_attention" and "full_attention", one per layer',
    "share": "a fraction (0 to 1) of head_dim that is even: RoPE turns pairs",
    "indices": "a list of layer numbers (from 0)", "k": "a whole number from 1 to num_experts"}

CONFIG = {  # the config.json entries the model reads -> the kind of value each must hold
    "model_type": "model", "hidden_size": "count", "intermediate_size": "count",
    "num_hidden_layers": "count", "num_attention_heads": "count", "num_key_value_heads": "count",
    "vocab_size": "count", "max_position_embeddings": "count", "head_dim": "even",
    "rms_norm_eps": "positive", "rope_theta": "positive", "tie_word_embeddings": "bool",
    "eos_token_id": "ids", "quantization": "quantization"}

MOE_CONFIG = {  # a mixture of experts' entries -> their kind (Qwen3-MoE's; Qwen3.5-MoE's: below)
    "num_experts": "count", "num_experts_per_tok": "k", "moe_intermediate_size": "count",
    "norm_topk_prob": "bool", "decoder_sparse_step": "count", "mlp_only_layers": "indices"}
MOE35_CONFIG = {"num_experts": "count", "num_experts_per_tok": "k",  # every layer's experts
                "moe_intermediate_size": "count", "shared_expert_intermediate_size": "count"}
YARN_CONFIG = {"factor": "positive", "original_max_position_embeddings": "count",  # and these,
               "beta_fast": "positive", "beta_slow": "positive", "truncate": "bool",  # if given
               "attention_factor": "positive"}
QWEN35_CONFIG = {  # Qwen3.5's own config.json entries (in its text_config) -> their kind
    "layer_types": "layers", "linear_num_key_heads": "count", "linear_num_value_heads": "count",
    "linear_key_head_dim": "count", "linear_value_head_dim": "count",
    "linear_conv_kernel_dim": "count", "partial_rotary_factor": "share",
    "mtp_num_hidden_layers": "mtp"}

UNSUPPORTED = {  # config.json entries that change the math -> (the values computed here, else what)
    "n_group": ((None,), "grouped routing (experts chosen within groups)"),
    "topk_group": ((None,), "grouped routing (experts chosen within groups)"),
    "scoring_func": (("softmax",), "a router scored other than by a softmax"),
    "attention_bias": ((False,), "biases in the attention projections"),
    "hidden_act": (("silu",), "an activation other than SiLU"),
    "use_sliding_window": ((False,), "sliding-window attention"),
    "quantization_config": ((None,), "weights quantised in this format"),
    # A DeltaNet's output gate (newer Qwen's configs; Megatron's name): SiLU here, swish by name
    "output_gate_type": (("swish", "silu"), "a DeltaNet output gate other than SiLU (swish)"),
    "linear_attention_output_gate_activation": (("swish", "silu"),
                                                "a DeltaNet output gate other than SiLU (swish)")}

def fits(value, kind, cfg):
    """Does a config value have the kind CONFIG names? cfg: its entries checked so far."""
    whole, number = type(value) is int and value >= 1, type(value) in (int, float) and value > 0
    if kind == "layers":  # (Qwen3.5's entries are checked after CONFIG's)
        return isinstance(value, list) and len(value) == cfg["num_hidden_layers"] \
            and all(layer in ("linear_attention", "full_attention") for layer in value)
    if kind == "share":
        return number and int(cfg["head_dim"] * value) in range(2, cfg["head_dim"] + 1, 2)
    if kind == "indices":
        return isinstance(value, list) and all(i in range(cfg["num_hidden_layers"]) for i in value)
    if kind == "k":
        return type(value) is int and 1 <= value <= cfg.get("num_experts", 0)
    return {"count": whole, "even": whole and value % 2 == 0, "positive": number,
            "model": value in ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe"),
            "bool": type(value) is bool,
            "ids": value is None or all(type(i) is int and i >= 0 for i in as_list(value)),
            "quantization": value is None or isinstance(value, dict)
            and value.get("mode", "affine") == "affine",
            "mtp": type(value) is int and value in (0, 1)}[kind]

def read_configs(folder):
    """config.json's CONFIG entries (and a model's own: Qwen3.5's, a mixture's, YaRN's), checked,
    and "eos_ids": its and generation_config.json's."""
    path, gen_path = folder / "config.json", folder / "generation_config.json"
    raw = read_file(path, parse_json, "valid JSON")
    gen = read_file(gen_path, parse_json, "valid JSON") if gen_path.exists() else {}
    for file, data in [(path, raw), (gen_path, gen)]:
        if not isinstance(data, dict):
            raise UserError(f"{file} must hold a JSON object {{...}}, not {shown_json(data, 40)}")
    model_type = raw.get("model_type")  # (its family, qwen3 or qwen3_5, and whether experts)
    model_type = model_type if isinstance(model_type, str) else None  # (else: said below)
    cfg, scaled = flat_config(raw, model_type)
    moe_entries = {"qwen3_moe": MOE_CONFIG, "qwen3_5_moe": MOE35_CONFIG}.get(model_type, {})
    qwen35 = QWEN35_CONFIG if model_type in ("qwen3_5", "qwen3_5_moe") else {}
    entries = {**CONFIG, **qwen35, **moe_entries}
    if model_type == "qwen3_5_moe":  # every layer's MLP a mixture: no dense width
        del entries["intermediate_size"]
    gen = {"eos_token_id": None, **gen}  # generation_config.json's is optional
    for file, data, names in [(path, cfg, entries), (gen_path, gen, ["eos_token_id"])]:
        for name in names:
            if name not in data:
                raise UserError(f"{file} has no '{name}' entry")
            if not fits(data[name], entries[name], cfg):
                raise UserError(f"{file}: {name} must be {KINDS[entries[name]]}, "
                                f"not {shown_json(data[name])}")
    check_the_math(cfg, path, model_type)
    yarn_entries = checked_yarn(cfg.get("rope_scaling"), path, scaled)
    if yarn_entries:  # the context it reaches: factor x the original (Qwen's cards keep theirs)
        cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], int(
            yarn_entries["factor"] * yarn_entries["original_max_position_embeddings"]))
    eos = set(as_list(cfg["eos_token_id"]) + as_list(gen["eos_token_id"])) - {None}
    return {**{name: cfg.get(name) for name in CONFIG}, "eos_ids": eos,
            "moe": mixture_config(cfg, model_type, moe_entries), "yarn": yarn_entries,
            "model_type": model_type.removesuffix("_moe"),  # its family: the code's branches
            "qwen35": {name: cfg[name] for name in qwen35}}

def flat_config(raw, model_type):
    """config.json's entries in one dict, as transformers reads them: Qwen3.5's language model's
    (text_config), transformers 5's rope_parameters, the defaults -> it, and the name of the
    entry that scales RoPE ("rope_scaling", or "rope_parameters" where that holds it)."""
    cfg, scaled = raw, "rope_scaling"
    if model_type in ("qwen3_5", "qwen3_5_moe") and isinstance(raw.get("text_config"), dict):
        cfg = {**raw, **raw["text_config"], "model_type": model_type}  # the language model's
    nested = cfg.get("rope_parameters")
    if isinstance(nested, dict):  # transformers 5 writes rope_theta (and scaling) here
        cfg = {"rope_theta": nested.get("rope_theta"), **nested, **cfg}
        if nested.get("rope_type", nested.get("type", "default")) != "default":  # "yarn", say
            cfg["rope_scaling"], scaled = nested, "rope_parameters"
    cfg = {"tie_word_embeddings": False, "eos_token_id": None, "quantization": None,
           "mtp_num_hidden_layers": 0, "decoder_sparse_step": 1, "mlp_only_layers": [], **cfg}
    if cfg.get("quantization_config") == cfg["quantization"]:  # MLX writes its own twice
        cfg.pop("quantization_config", None)
    return cfg, scaled

def check_the_math(cfg, path, model_type):
    """The entries that change the math: each as this file computes it, or a UserError."""
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise UserError(f"{path}: num_attention_heads must be a multiple of num_key_value_heads")
    if model_type == "qwen3_5_moe" and cfg.get("norm_topk_prob", True) is not True:
        raise UserError(f"{path}: norm_topk_prob is {shown_json(cfg['norm_topk_prob'])}: "
                        "Qwen3.5-MoE's top k are renormalised (transformers has no such entry)")
    for name, (computed, other) in UNSUPPORTED.items():
        if name in cfg and cfg[name] not in computed:
            raise UserError(f"{path}: {name} is {shown_json(cfg[name])}: this script does not run "
                            f"{other}")

def mixture_config(cfg, model_type, moe_entries):  # a mixture's entries, and its MoE layers
    if not moe_entries:
        return {}
    moe_cfg = {"norm_topk_prob": True, **{name: cfg[name] for name in moe_entries}}
    moe_cfg["layers"] = list(range(cfg["num_hidden_layers"]))  # Qwen3.5-MoE: every layer's
    if model_type == "qwen3_moe":  # Qwen3-MoE's rule, as transformers and mlx-lm have it
        moe_cfg["layers"] = [i for i in moe_cfg["layers"] if i not in cfg["mlp_only_layers"]
                             and (i + 1) % cfg["decoder_sparse_step"] == 0]
    return moe_cfg

def checked_yarn(scaling, path, entry="rope_scaling"):
    """rope_scaling (or rope_parameters' scaling, entry: its name): None, or YaRN's entries,
    checked: factor and original_max_position_embeddings required (mlx-lm and transformers
    default the second differently), the rest as transformers defaults them. Any other scaling:
    a UserError."""
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if scaling is None or isinstance(scaling, dict) and kind in (None, "default"):
        return {}  # the plain RoPE: said so, or no type said ({} too), as transformers reads it
    if kind != "yarn":
        raise UserError(f"{path}: {entry} is {shown_json(scaling)}: this script runs YaRN "
                        '("rope_type": "yarn") alone of the scaled RoPEs')
    for name in ("mscale", "mscale_all_dim"):  # DeepSeek's: a scale the Qwen models do not use
        if name in scaling:
            raise UserError(f"{path}: {entry}'s {name} is {shown_json(scaling[name])}: this "
                            "script does not run YaRN's mscale (DeepSeek's)")
    for name, value_kind in YARN_CONFIG.items():
        required = name in ("factor", "original_max_position_embeddings")
        if required and name not in scaling:
            raise UserError(f"{path}: {entry} has no '{name}' entry, which YaRN needs (the "
                            "libraries default it differently)")
        if name in scaling and not fits(scaling[name], value_kind, {}):
            raise UserError(f"{path}: {entry}'s {name} must be {KINDS[value_kind]}, not "
                            f"{shown_json(scaling[name])}")
    return {name: scaling[name] for name in YARN_CONFIG if name in scaling}

def weight_files(folder):
    """{file: its tensors, None for all}: as model.safetensors.index.json names them, else
    model.safetensors. No other *.safetensors: an older download left there would mix in."""
    index, files = folder / "model.safetensors.index.json", {}
    if not index.exists():
        return {folder / "model.safetensors": None}
    weight_map = read_file(index, parse_json, "valid JSON")
    if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
        raise UserError(f"{index} has no 'weight_map' entry {{tensor: file}}: download it again")
    for name, file in weight_map["weight_map"].items():
        files.setdefault(folder / file, []).append(name)
    return files

def read_weights(folder, cfg, dtype, memory=None):
    """The files -> the tensors the model uses, of the shapes config.json predicts, finite in dtype
    (or their own), read from disk now; beyond memory (load_checked()'s), a mixture's experts a
    pool of slots a block, read when picked (cfg["pools"])."""
    weights, source = {}, {}
    for file, names in weight_files(folder).items():
        tensors = read_file(file, mx.load, "a complete safetensors file")  # lazy: read on use
        for name in tensors if names is None else names:
            if name not in tensors:
                raise UserError(f"{file} has no tensor {name}, which "
                                f"{folder / 'model.safetensors.index.json'} says it holds")
            key = name.replace("language_model.", "", 1)  # Qwen3.5's names, Hugging Face's or MLX's
            weights[key], source[key] = tensors[name], file
    # Hugging Face's Qwen3.5 (its convolution (C, 1, K)) stores its norms, but the DeltaNet's, as
    # offsets from 1: 1 is added in the stored dtype, as mlx-lm does. mlx-lm's own hold gains.
    hf = any(name.endswith("conv1d.weight") and w.shape[1] == 1 for name, w in weights.items())
    for name, w in weights.items():
        if name.endswith("conv1d.weight"):
            weights[name] = w.reshape(w.shape[0], -1)                 # (C, K)
        elif hf and name.endswith(("norm.weight", "norm_embedding.weight", "norm_hidden.weight")) \
                and ".linear_attn." not in name:
            weights[name] = w + 1
        if dtype is not None and w.dtype != mx.uint32 and not name.endswith("A_log"):
            weights[name] = weights[name].astype(dtype)  # packed bits stay packed, A_log as stored
    if cfg["tie_word_embeddings"]:  # one table, both ways (a stored copy is not used)
        for part in (".weight", ".scales", ".biases"):  # a quantised table has all three
            weights["lm_head" + part] = weights.get("model.embed_tokens" + part)
    for name in weights:
        if name.endswith(("mlp.gate.bias", "e_score_correction_bias")):  # (else left unread)
            raise UserError(f"tensor {name} in {source[name]}: this script does not run a router "
                            "bias")
    tensors = w = None  # weights alone holds them now: what is cut or stacked is then freed
    size = pool_size(weights, cfg, memory)  # None: every expert in memory
    if cfg["moe"]:  # (streamed: stacked lazily, their shapes checked, never read)
        stack_experts(weights, cfg, folder, read=size is None)
    weights = checked_shapes(weights, expected_shapes(cfg, weights), folder)
    if size is not None:
        cfg["pools"] = make_pools(weights, cfg, size, weight_files(folder))
    for name in list(weights) if cfg["group"] else []:  # several processes: this one's parts
        weights[name] = shard(name, weights[name], cfg["group"], cfg["qwen35"])
    # The MTP head's layer is also read as layer N (num_hidden_layers), after the model's own.
    for name in [name for name in weights if name.startswith("mtp.layers.0.")]:
        weights[f"model.layers.{cfg['num_hidden_layers']}.{name[13:]}"] = weights[name]
    read_now(weights, source, cfg["tie_word_embeddings"], dtype)
    return weights

def read_now(weights, source, tied, dtype):
    """The weights held in memory read from disk now, so that generation times only generation,
    and checked finite: a tensor with NaN or inf is refused, naming its file (source[name]). A
    pool's slots are empty here: an expert read when picked is checked only through the logits."""
    # A sum is NaN or inf if any value is (packed words aside; a tied head is its table's).
    sums = {name: w.sum() for name, w in weights.items()
            if w.dtype != mx.uint32 and not (tied and "lm_head" in name)}
    mx.eval(weights, sums)
    for name, total in sums.items():  # (a sum can overflow float16 alone: then check each value)
        if not mx.isfinite(total).item() and not mx.isfinite(weights[name]).all().item():
            why = "the file is damaged; download it again"
            if dtype is not None:  # a dtype given: taken to be the cast's doing
                why = f"its values are too large for {str(dtype)[9:]} (float32 holds them)"
            raise UserError(f"tensor {name} in {source[name]} holds NaN or inf: {why}")

def stack_experts(weights, cfg, folder, read=True):
    """Each mixture's experts, stacked in weights as Qwen3.5-MoE's release holds them:
    experts.gate_up_proj (E, 2I, D), gate's rows first, and experts.down_proj (E, D, I), a
    .scales and .biases beside each if quantised. Stacked here: Qwen3-MoE's one tensor an expert
    (each named if missing or misshapen), and MLX's switch_mlp.* (gate and up apart; one of the
    three missing, named); a block at a time, evaluated (read=False: not) before the next, so
    that the model is never held twice."""
    e, i, d = cfg["moe"]["num_experts"], cfg["moe"]["moe_intermediate_size"], cfg["hidden_size"]
    for p in sorted({name.split("mlp.")[0] + "mlp." for name in weights if "mlp.experts." in name
                     or "mlp.switch_mlp." in name}):
        switch = [f"{p}switch_mlp.{m}_proj" for m in ("gate", "up", "down")]
        for part in ("", ".scales", ".biases") if any(m + ".weight" in weights for m in switch) \
                else []:  # MLX's conversion: stacked already (E, rows, packed columns)
            gate, up, down = found = [weights.pop(m + (part or ".weight"), None) for m in switch]
            lost = [m + (part or ".weight") for m, w in zip(switch, found) if w is None]
            # Each weight is needed; scales and biases, for gate and up alike (one tensor here),
            # and down's on its own: mlx-lm leaves a projection too narrow for a group unpacked.
            if lost and (not part or (gate is None) != (up is None)):
                raise UserError(f"tensor {lost[0]} is missing in {folder}")
            if gate is not None:
                weights[p + "experts.gate_up_proj" + part] = mx.concatenate([gate, up], axis=1)
            if down is not None:
                weights[p + "experts.down_proj" + part] = down
        if p + "experts.0.gate_proj.weight" in weights:  # Hugging Face's Qwen3-MoE: one each
            each = {"gate": (i, d), "up": (i, d), "down": (d, i)}
            checked_shapes(weights, {f"{p}experts.{n}.{m}_proj.weight": shape for n in range(e)
                                     for m, shape in each.items()}, folder)  # each, or named
            stacked = {m: mx.stack([weights.pop(f"{p}experts.{n}.{m}_proj.weight")
                                    for n in range(e)]) for m in each}  # (E, rows, columns)
            weights[p + "experts.gate_up_proj"] = mx.concatenate([stacked["gate"],
                                                                  stacked["up"]], axis=1)
            weights[p + "experts.down_proj"] = stacked["down"]
        if read:
            mx.eval([w for name, w in weights.items() if name.startswith(p + "experts.")])

def machine_memory():
    """The bytes the weights may hold here: on a Mac, MLX's recommended working set for its GPU;
    elsewhere the physical memory less a fifth (the system's, Python's, the KV cache's)."""
    info = mx.device_info()
    if "max_recommended_working_set_size" in info:
        return info["max_recommended_working_set_size"]
    return 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

def pool_size(weights, cfg, memory):
    """The slots a mixture block keeps when the weights exceed memory (bytes; None: this
    machine's) -> their number, or None: every expert fits. A dense model that does not fit: a
    line, and on (memory given: refused); a pool too small for one token's experts: refused."""
    budget, moe_cfg, shapes = memory or machine_memory(), cfg["moe"], expected_shapes(cfg, weights)

    def kept(name):  # by checked_shapes(): a tensor it expects (its scales, biases), an expert's
        base = name.removesuffix(".scales").removesuffix(".biases")  # (not: a vision tower's)
        return base in shapes or base + ".weight" in shapes or ".mlp.experts." in name \
            or ".mlp.switch_mlp." in name
    used = {id(w): w for name, w in weights.items() if w is not None and kept(name)}  # tied: once
    total = sum(w.nbytes for w in used.values())
    if total <= budget:
        return None
    streamed = tuple(f"model.layers.{i}.mlp.{kind}" for i in moe_cfg.get("layers", [])
                     for kind in ("experts.", "switch_mlp."))  # (the MTP head's stay)
    experts_bytes = sum(w.nbytes for name, w in weights.items() if name.startswith(streamed))
    given = f"--memory {memory / 1e9:g} GB" if memory else f"this machine's {budget / 1e9:.1f} GB"
    if not experts_bytes:  # a dense model
        line = (f"the weights are {total / 1e9:.2f} GB, more than {given}: a quantised folder "
                "holds less (Qwen/Qwen3-8B-MLX-4bit: a quarter of bfloat16's)")
        if memory:
            raise UserError(line)
        note(f"{line}; going on, the system will swap")
        return None
    if cfg["group"]:
        raise UserError(f"the weights are {total / 1e9:.2f} GB, more than {given}: experts from "
                        "disk run in one process (under mlx.launch each holds 1/N of them)")
    blocks, top_k = len(moe_cfg["layers"]), moe_cfg["num_experts_per_tok"]
    each = experts_bytes / (moe_cfg["num_experts"] * blocks)  # an expert's bytes in a block
    size = int((budget - (total - experts_bytes)) // (each * blocks))
    if size < top_k:
        least = total - experts_bytes + top_k * each * blocks
        raise UserError(f"{given} cannot hold the model without its experts, and {top_k} "
                        f"experts a block besides (one token's): the least that works is --memory "
                        f"{math.ceil(least / 1e5) / 1e4:.4f}")  # (GB, rounded up)
    return size

def make_pools(weights, cfg, size, files):
    """The streamed blocks' experts -> slots: each stacked tensor of them (S, ...) zeros in
    weights, and a Pool a block, told where each expert lies in files -> {block's prefix: Pool}."""
    places, stamps = {}, {}
    for file in files:
        stat = os.stat(file)  # (read_span() compares the file's size and time with these)
        stamps[str(file)] = (stat.st_size, stat.st_mtime_ns)
        for name, (dtype, shape, offset, nbytes) in safetensors_header(file).items():
            places[name.replace("language_model.", "", 1)] = (str(file), dtype, shape, offset,
                                                              nbytes)
    pools = {}
    for i in cfg["moe"]["layers"]:
        p = f"model.layers.{i}.mlp."
        spans = expert_spans(p, places, cfg["moe"]["num_experts"])
        for name, (stored, _, _) in spans.items():
            if stored not in STORED:
                raise UserError(f"tensor {name} is stored as {stored}: experts from disk read "
                                f"{', '.join(STORED)}")
            weights[name] = mx.zeros((size, *weights[name].shape[1:]), weights[name].dtype)
        pools[p] = Pool(spans, stamps, size)
    return pools

def expected_shapes(cfg, weights):
    """The tensors the model uses -> the shapes config.json's sizes give them."""
    d, f, v, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q_width, kv_width = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    qwen35, moe_cfg = cfg["qwen35"], cfg["moe"]
    norms = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    dense = {"mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
             "mlp.down_proj.weight": (d, f)}
    mixture = {}  # a mixture's MLP: the router, the experts stacked, Qwen3.5's shared expert
    if moe_cfg:
        e, i, s = moe_cfg["num_experts"], moe_cfg["moe_intermediate_size"], moe_cfg.get(
            "shared_expert_intermediate_size")
        mixture = {"mlp.gate.weight": (e, d), "mlp.experts.gate_up_proj": (e, 2 * i, d),
                   "mlp.experts.down_proj": (e, d, i)}
        if s:
            mixture.update({"mlp.shared_expert.gate_proj.weight": (s, d),
                            "mlp.shared_expert.up_proj.weight": (s, d),
                            "mlp.shared_expert.down_proj.weight": (d, s),
                            "mlp.shared_expert_gate.weight": (1, d)})
    full = {"self_attn.q_proj.weight": (2 * q_width if qwen35 else q_width, d),  # Qwen3.5: gate
            "self_attn.k_proj.weight": (kv_width, d), "self_attn.v_proj.weight": (kv_width, d),
            "self_attn.o_proj.weight": (d, q_width), "self_attn.q_norm.weight": (hd,),
            "self_attn.k_norm.weight": (hd,)}
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
              "lm_head.weight": (v, d)}
    if qwen35:  # Qwen3.5's Gated DeltaNet layers, and its MTP head (all its tensors, or none)
        keys = qwen35["linear_num_key_heads"] * qwen35["linear_key_head_dim"]  # 2048
        values = qwen35["linear_num_value_heads"] * qwen35["linear_value_head_dim"]  # 2048
        a, heads = "linear_attn.", (qwen35["linear_num_value_heads"],)
        delta = {a + "in_proj_qkv.weight": (2 * keys + values, d),
                 a + "in_proj_z.weight": (values, d), a + "in_proj_b.weight": (*heads, d),
                 a + "in_proj_a.weight": (*heads, d), a + "dt_bias": heads, a + "A_log": heads,
                 a + "conv1d.weight": (2 * keys + values, qwen35["linear_conv_kernel_dim"]),
                 a + "norm.weight": (qwen35["linear_value_head_dim"],),
                 a + "out_proj.weight": (d, values)}
        if qwen35["mtp_num_hidden_layers"] and any(name.startswith("mtp.") for name in weights):
            layer = {**norms, **(mixture or dense), **full}  # (Qwen3.5-MoE's: a mixture too)
            shapes.update({"mtp.fc.weight": (d, 2 * d), "mtp.norm.weight": (d,),
                           "mtp.pre_fc_norm_embedding.weight": (d,),
                           "mtp.pre_fc_norm_hidden.weight": (d,),
                           **{f"mtp.layers.0.{name}": s for name, s in layer.items()}})
    for n in range(cfg["num_hidden_layers"]):
        mixer = delta if qwen35 and qwen35["layer_types"][n] == "linear_attention" else full
        mlp = mixture if moe_cfg and n in moe_cfg["layers"] else dense
        shapes.update({f"model.layers.{n}.{name}": s for name, s in {**norms, **mlp,
                                                                      **mixer}.items()})
    return shapes

def checked_shapes(weights, shapes, folder):
    """weights, only the tensors the model uses, each of the shape config.json predicts. MLX's
    quantised ones: packed words, a scale and a bias per group of a row's numbers."""
    for name, shape in list(shapes.items()):
        base = name.removesuffix(".weight")  # (a stacked expert tensor's name has no .weight)
        scales = weights.get(base + ".scales")
        if scales is not None and len(shape) >= 2 and name in weights:
            bits = weights[name].shape[-1] * 32 / shape[-1]            # 4, say
            group_size = shape[-1] / scales.shape[-1]                    # 64, say
            if bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128):
                raise UserError(f"tensor {name} in {folder}: {weights[name].shape} packed with "
                                f"scales {scales.shape} is not MLX's quantisation of {shape}")
            shapes[name] = (*shape[:-1], weights[name].shape[-1])
            shapes[base + ".scales"] = shapes[base + ".biases"] = scales.shape
    for name, shape in shapes.items():
        untied = " (tie_word_embeddings is false)" if name == "lm_head.weight" else ""
        if weights.get(name) is None:
            raise UserError(f"tensor {name} is missing in {folder}{untied}; expected shape {shape}")
        if weights[name].shape != shape:
            raise UserError(f"tensor {name} has shape {weights[name].shape} in {folder}; "
                            f"expected shape {shape}")
    return {name: weights[name] for name in shapes}  # what is never used is dropped

def read_tokenizer(folder, cfg):
    """tokenizer.json, every id of which (added tokens too) is a row of the embedding table."""
    path = folder / "tokenizer.json"
    tok = read_file(path, Tokenizer.from_file, "a tokenizer that `tokenizers` reads")
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= cfg["vocab_size"]:
        raise UserError(f"{path} has ids up to {top}, past the {cfg['vocab_size']} rows of the "
                        f"embedding (vocab_size in {folder / 'config.json'}): another model?")
    return tok

# ─── The download: a folder, or the Hugging Face Hub ───

def model_folder(model, may_fetch=True):
    """--model -> its folder; the default folder, or a plain owner/name repo id not whole in the
    Hugging Face cache, downloaded first (a second run asks the Hub nothing). may_fetch=False (under
    mlx.launch every process would fetch at once, and other hosts have no folder): a UserError."""
    path = Path(model).resolve()
    if path.is_file():
        raise UserError(f"{path} is a file, not a folder (a model is a folder)")
    if path == HERE / "Qwen3-0.6B" and not complete(path):  # the article's folder
        return download(REPO, path) if may_fetch else not_fetched(REPO, path)
    if path.exists():
        return path
    if not re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", model):  # ./x, ../x, a/b/c, x: paths
        raise UserError(f"{path} does not exist (--model takes a folder, or a Hugging Face repo "
                        f"id such as {REPO})")
    from huggingface_hub import try_to_load_from_cache  # (only here: it takes a moment to import)
    config = try_to_load_from_cache(model, "config.json")  # its path, or a mark that it is not
    cached = Path(config).parent if isinstance(config, str) else None
    if cached and complete(cached):
        return cached
    return download(model, None) if may_fetch else not_fetched(model, None)

def not_fetched(repo, local_dir):
    raise UserError(f"{local_dir or repo} is not here whole, and under mlx.launch nothing is "
                    "downloaded (each process would fetch it at once): on each host, first run "
                    f"{hand_command(repo, local_dir)}")

def complete(folder):  # does it hold what load_checked() reads? (generation_config.json: optional)
    needed = [folder / "config.json", folder / "tokenizer.json", *weight_files(folder)]
    return all(file.exists() for file in needed)

def download(repo, local_dir):
    """Fetch what local_dir (None: the Hugging Face cache) lacks of repo's configs, template and
    weights (the default folder: FILES), each file announced first; then the Hub's checksums.
    Meanwhile Ctrl-C lets huggingface_hub tidy up, its retries show, and hf_xet's are bounded;
    after, on every way out, the caller's settings again."""
    from huggingface_hub import constants, logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_warning()  # its retries show, a line each
    # The Hub serves large files from Xet storage, through hf_xet, which reads these when its
    # session is made (a process's first Xet download). Unless set, a stalled read ends after
    # huggingface_hub's own timeout (10 s), not hf_xet's 300, and a range is tried again for at
    # most a minute (its retries, by their growing delays, can take 6): a persistent fault ends
    # in one to three minutes, not 3 to 30. (Each is read with its unit: "60" alone is ignored.)
    bounds = {"HF_XET_CLIENT_READ_TIMEOUT": f"{constants.HF_HUB_DOWNLOAD_TIMEOUT}s",
              "HF_XET_CLIENT_RETRY_MAX_DURATION": "60s"}
    unset = [name for name in bounds if name not in os.environ]
    os.environ.update({name: bounds[name] for name in unset})
    try:
        with interruptible(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="huggingface_hub")  # "not enough free disk"
            return fetch_missing(repo, local_dir)
    finally:
        logging.set_verbosity(verbosity)
        for name in unset:
            os.environ.pop(name, None)

def fetch_missing(repo, local_dir):  # download()'s work -> the folder
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    api, name, fetched, into = HfApi(), "the file list", {}, local_dir or constants.HF_HUB_CACHE
    print(f"{repo}: asking {constants.ENDPOINT} which files to fetch into {into}",
          file=sys.stderr, flush=True)
    try:
        # The plan, from one listing of the repo. (huggingface_hub's own, snapshot_download(...,
        # dry_run=True), asks the Hub for each file before any comes, names none in its errors,
        # and, the network down, shows no retry: measured on huggingface_hub 2.4.0.)
        files = {f.path: f.size for f in api.list_repo_tree(repo) if hasattr(f, "size")}
        if not any(name.endswith(".safetensors") for name in files):
            raise UserError(f"{repo} has no model.safetensors: this script runs safetensors "
                            f"checkpoints (the repo holds {', '.join(list(files)[:7])})")
        wanted = [name for name in files if re.fullmatch(r"[^/]+\.(json|jinja|safetensors)", name)
                  and (local_dir is None or name in FILES)]
        for name in wanted:  # each: there from an earlier run (a path), or not (a mark), or fetched
            path = local_dir / name if local_dir else try_to_load_from_cache(repo, name)
            if not isinstance(path, (str, Path)) or not Path(path).exists():
                print(f"{name}: {tqdm.format_sizeof(files[name])}B from {constants.ENDPOINT}/"
                      f"{repo} into {into}", file=sys.stderr, flush=True)
                path = fetched[name] = Path(fetch(repo, name, local_dir))
        name = "the checksums"  # of the files fetched now (none: the Hub is not asked)
        checked = api.verify_repo_checksums(repo, local_dir=local_dir) if fetched else None
        for bad in checked.mismatches if checked else []:
            damaged = fetched.get(bad["path"])
            links = [damaged] if damaged else []  # in the cache: a link to a blob (on Xet
            while links and links[-1].is_symlink():  # storage, to a link to a shared file)
                links.append(links[-1].parent / os.readlink(links[-1]))
            for link in reversed(links):  # removed: the file, and each link that led to it
                link.unlink()
            if damaged:
                raise UserError(f"{damaged} is not the file the Hub announced ({bad['algorithm']} "
                                f"{bad['actual'][:12]}..., not {bad['expected'][:12]}...): damaged "
                                "on the way, removed; run again to fetch it")
    except KeyboardInterrupt:  # exit status 130, as the shell gives Ctrl-C
        print(f"error: the download was interrupted during {name}; run the same command again: it "
              "keeps the files already complete and fetches the rest (a file begun, from its "
              "start)", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:  # the Hub's, the network's or the disk's, else a bug: its traceback
        why = download_trouble(e, into)
        if why is None:
            raise
        raise UserError(f"could not download {name} of {repo}: {why}. To fetch it by hand, run "
                        f"this, then the same command again: {hand_command(repo, local_dir)}"
                        ) from None
    return Path(path).parent

def hand_command(repo, local_dir):  # the shell command that fetches what download() would
    if local_dir is None:  # into the Hugging Face cache
        return f"hf download {repo} " + " ".join(f'--include "{pattern}"' for pattern in FETCHED)
    return f"hf download {repo} {' '.join(FILES)} --local-dir {shlex.quote(str(local_dir))}"

def fetch(repo, name, local_dir, tries=5):
    """hf_hub_download(), watched, tried again when the connection is reset mid-file on the plain
    path (huggingface_hub resumes a connection closed early, not a reset one; hf_xet tries Xet
    storage again by itself), a line each time; each try starts from the file's start:
    huggingface_hub deletes what a failed try fetched."""
    from huggingface_hub import hf_hub_download
    for n in range(1, tries + 1):
        try:
            with watched(name) as bar:
                return hf_hub_download(repo, name, local_dir=local_dir, tqdm_class=bar)
        except Exception as e:  # a reset: tried again; anything else, download()'s to report
            if n == tries or not was_reset(e):
                raise
        print(f"{name}: the connection broke; trying again from its start ({n + 1} of {tries})",
              file=sys.stderr, flush=True)

QUIET = 20  # seconds a file may bring nothing before a line says so (watched())

@contextmanager
def watched(name, quiet=QUIET):
    """Inside: the bar class for hf_hub_download(): huggingface_hub's (at a terminal only), one a
    file; and, on a thread of its own, a watch that says when nothing of the file has come for
    quiet seconds, and again every quiet more (hf_xet tries Xet storage again by itself, saying
    nothing, for up to a minute or so). After, on every way out: the watch ended. On Xet storage
    the bar counts the bytes written: the bar of those received, which huggingface_hub would draw
    whole when the download ends, arrived or not, is not drawn."""
    from huggingface_hub.utils import tqdm as hub_tqdm
    heard, done = [time.monotonic()], threading.Event()  # heard: when anything last came

    class Bar(hub_tqdm):
        def update(self, n=1):  # bytes written (Xet), or received (plain)
            heard[0] = time.monotonic()
            return super().update(n)

        def update_transfer(self, n=1):  # bytes received (Xet's; plain calls it too): not drawn
            heard[0] = time.monotonic()

        def set_transfer_postfix_str(self, postfix, refresh=False):  # (their speed: not shown)
            pass

    def watch():
        since, said = heard[0], 0  # said: the lines about this silence
        while not done.wait(1):
            silent = time.monotonic() - heard[0]
            if heard[0] != since:
                since, said = heard[0], 0
            elif silent >= (said + 1) * quiet:
                said = int(silent // quiet)
                hub_tqdm.write(f"{name}: nothing has come for {said * quiet} s; still trying "
                               "(Ctrl-C stops)", file=sys.stderr)

    watcher = threading.Thread(target=watch, name=f"watching {name}", daemon=True)
    watcher.start()
    try:
        yield Bar
    finally:
        done.set()
        watcher.join()

def was_reset(error):
    """Whether the connection was reset (TCP RST) under the error: it, or what it was raised from
    or while handling."""
    while error is not None and not isinstance(error, ConnectionResetError):
        error = error.__cause__ or error.__context__
    return error is not None

def download_trouble(error, into):
    """What stopped a download, in a few words (None: none of these, a bug): the first such cause
    of the error, or of what it was raised from or while handling."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    while error is not None:
        e, error = error, error.__cause__ or error.__context__
        if isinstance(e, RuntimeError) and str(e).startswith("Task error: "):  # hf_xet's
            return xet_trouble(str(e), into)
        if type(e).__module__ == "hf_xet":  # its typed errors (refused, not found): its words
            return f"Xet storage: {e}"
        if isinstance(e, HfHubHTTPError) and e.response is not None:
            return f"the Hub answered {e.response.status_code} {e.response.reason_phrase}"
        if isinstance(e, OfflineModeIsEnabled):
            return "offline: HF_HUB_OFFLINE is set"
        if isinstance(e, ConnectionResetError) or type(e).__name__ == "RemoteProtocolError":
            return "the connection broke before the Hub's answer was whole"
        if isinstance(e, (ConnectionError, socket.gaierror)):  # refused, no route, no such host
            return f"the Hub could not be reached at {constants.ENDPOINT}"
        if isinstance(e, TimeoutError):
            return "the Hub stopped answering (timed out)"
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return f"the disk is full where it goes ({into})"
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS,
                                                  errno.ENOTDIR, errno.EEXIST):
            return f"{e.filename} cannot be written: {e.strerror.lower()}"
    return None

def xet_trouble(text, into):
    """hf_xet's failure on Xet storage, in a few words. It raises a RuntimeError, caused by
    nothing: all it tells is its text, after its own retries of the range."""
    status = re.search(r"HTTP status [\w ]+\((\d+ [^)]*)\)", text)
    host = re.search(r"https?://[^/\s)]+", text)
    storage = f"Xet storage at {host[0]}" if host else "Xet storage"
    if "os error 28" in text:
        return f"the disk is full where it goes ({into})"
    if status:
        return f"{storage} answered {status[1]}"
    if "error decoding response body" in text:  # a reset, a close or a stall: the same words
        return f"the connection to {storage} broke or stalled before the file was whole"
    if "error sending request" in text:
        return f"{storage} could not be reached"
    if "Malformed data" in text:
        return f"{storage} sent damaged data ({text.split('Malformed data: ')[-1]})"
    return f"hf_xet, Xet storage's client: {text}"

# ─── Several processes ───

def check_split(cfg, n):
    """N processes each take 1/N of a block's heads and features: N must divide every count (and,
    quantised, leave whole groups of the numbers a row holds)."""
    qwen35, hd, quant, moe_cfg = cfg["qwen35"], cfg["head_dim"], cfg["quantization"], cfg["moe"]
    sizes = {"query heads": cfg["num_attention_heads"], "KV heads": cfg["num_key_value_heads"]}
    if not moe_cfg or len(moe_cfg["layers"]) < cfg["num_hidden_layers"]:  # a dense MLP somewhere
        sizes["MLP features"] = cfg["intermediate_size"]
    if moe_cfg:  # each expert's features (and the shared expert's) cut, as the dense MLP's
        sizes["expert features"] = moe_cfg["moe_intermediate_size"]
        if moe_cfg.get("shared_expert_intermediate_size"):
            sizes["shared expert features"] = moe_cfg["shared_expert_intermediate_size"]
    if qwen35:
        sizes.update({"DeltaNet key heads": qwen35["linear_num_key_heads"],
                      "DeltaNet value heads": qwen35["linear_num_value_heads"]})
    wrong = [f"{count} {what}" for what, count in sizes.items() if count % n]
    inputs = [sizes["query heads"] * hd] + [sizes[what] for what in sizes if "features" in what]
    if qwen35:  # (o_proj, down_proj and out_proj read the inputs cut)
        inputs.append(qwen35["linear_num_value_heads"] * qwen35["linear_value_head_dim"])
    if wrong:
        raise UserError(f"{n} processes cannot share this model's blocks: {n} does not divide its "
                        f"{', '.join(wrong)} (mlx.launch -n: a number that does)")
    if quant and any(width // n % quant["group_size"] for width in inputs):
        raise UserError(f"{n} processes cannot share this model's blocks: each one's part of a "
                        f"row would cut the quantisation's groups of {quant['group_size']} numbers "
                        "(mlx.launch -n: a smaller number)")

def all_ranks_agree(group, check, *args):
    """check(*args) -> its result. Several processes: each rank's UserError counted in one all_sum,
    so that all go on or all end; an error every rank met is said once (rank 0), one rank's own
    with its rank in front, and every line is out before any rank ends (mlx.launch ends the rest
    when one ends with an error)."""
    try:
        result, failed = check(*args), None
    except UserError as e:
        result, failed = None, e
    if group.size() > 1:
        failures = mx.distributed.all_sum(mx.array(failed is not None, mx.int32), group=group)
        if failures.item():
            if failed and failures.item() < group.size():  # this rank's own: its rank in front
                print(f"rank {group.rank()}: {failed.code}", file=sys.stderr, flush=True)
            elif failed and group.rank() == 0:  # every rank's: rank 0 says it once
                print(failed.code, file=sys.stderr, flush=True)
            barrier(group)
            raise SystemExit(1)
    if failed:
        raise failed
    return result

def check_launched(args):  # the flags mlx.launch cannot serve: it never ends the ranks' input
    if "-" in (args.prompt or []):
        raise UserError("--prompt - reads standard input to its end, which under mlx.launch never "
                        "comes: give the prompt's text")
    if args.chat and not args.prompt and not args.prompts:
        raise UserError("--chat without --prompt is a conversation on standard input, which "
                        "mlx.launch never ends: give --prompt, or chat in one process")

def barrier(group):  # every rank waits here for all the others (a sum of nothing)
    mx.distributed.all_sum(mx.array(0), group=group).item()

@contextmanager
def rank_zero_prints(group):
    """Inside: rank 0 alone prints, the others compute beside it (their standard output goes to
    os.devnull); after, on every way out, each rank's own sys.stdout again."""
    if group.rank() == 0:
        yield
        return
    with open(os.devnull, "w") as nowhere, redirect_stdout(nowhere):
        yield

def shared_seed(group):  # each process seeds itself at random: every rank takes rank 0's seed
    mine = int.from_bytes(os.urandom(3), "little") if group.rank() == 0 else 0
    return mx.distributed.all_sum(mx.array(mine), group=group).item()

def peak_memory():  # this process's peak memory, bytes; several processes: each rank's, in order
    peak = mx.array([mx.get_peak_memory()], mx.float32)
    return (peak if GROUP is None else mx.distributed.all_gather(peak, group=GROUP)).tolist()

def all_sum_seconds(n, x, tries=20):
    """n all-sums of x over GROUP, each of the one before's sum (as a pass's: each block needs the
    one before), in one graph as decoding runs them, timed alone: the best of tries, seconds. A
    busy machine delays some tries by far more than a sum takes: the best is the sums' own."""
    def chained():
        y = x
        for _ in range(n):
            y = mx.distributed.all_sum(y, group=GROUP)
        mx.eval(y)
    return min(timeit.repeat(chained, timer=time.perf_counter, number=1, repeat=tries))

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # Ctrl-C stops at once; the shell sees 130
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends it quietly, as it ends `cat`
    try:  # a UserError: its one line; a bug: its traceback
        main()
        sys.stdout.flush()  # what is still buffered: a full disk says so here, not at exit
    except OSError as e:  # only writing the text fails so (download(), read_file(): their own)
        if e.errno != errno.ENOSPC:
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second try at exit
        print("error: standard output cannot be written: no space left on device", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C in a chat at a terminal, not in an answer: it ends
        print(file=sys.stderr)
        sys.exit(130)
    except FloatingPointError as e:  # not_finite()'s: the logits overflowed the dtype
        if GROUP is None or GROUP.rank() == 0:  # (every rank's logits are the same: said once)
            flag = " (--dtype float32)" if str(e).endswith("compute in float32") else ""
            print(f"error: {e}{flag}", file=sys.stderr, flush=True)
        if GROUP is not None:  # the line out before any rank ends (mlx.launch ends the rest)
            barrier(GROUP)
        sys.exit(1)
