"""Mixtures of experts (Qwen3-MoE as Qwen3-30B-A3B, Qwen3.5-MoE as Qwen3.5-35B-A3B): the router,
the experts stacked and run by MLX's gather products, against the plain per-expert loop, mlx-lm,
and transformers where torch is installed; every layout a user meets (one tensor an expert, the
stacked release, MLX's 4-bit switch_mlp with its 8-bit router); all the rest the file does (a
batch, drafting, several processes, --explain), on tiny random checkpoints (tests/moe_checkpoints.py).

Error measure: max |ours - ref| / max |ref| over the logits (test_model.rel_err)."""
import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

import llm_inference as li
from test_cli_errors import assert_error, run_cli
from test_model import mlx_lm_logits, rel_err

# 42 tokens: 84 picks of 2 experts, past mlx-lm's and our sorting threshold (64): the prefill
# path sorts the tokens by expert; a decoded token (2 picks) does not.
TEXT = "The capital of France is Paris. The capital of Japan is Tokyo. Once upon a time there " \
       "was a small model that learned"

VARIANTS = {"qwen3_moe": {}, "mixed": dict(mlp_only_layers=[1]),
            "sparse_step": dict(decoder_sparse_step=2), "not_renormalised": dict(norm_topk_prob=False),
            "tied": dict(lm_head="tied")}


def experts_loop(x, layer, folder):
    """The readable form, from the file's own tensors: for each token, its router's probabilities
    (softmax in float32), the k likeliest renormalised (if the config says), and each chosen
    expert's SwiGLU of the token, weighted and added; the shared expert through its gate."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    weights = {k.replace("model.language_model.", "model."): v
               for k, v in mx.load(str(Path(folder) / "model.safetensors")).items()}
    p, k = f"model.layers.{layer}.mlp.", cfg["num_experts_per_tok"]

    def expert(e, name):  # one expert's (rows, columns) matrix, either layout
        if p + "experts.gate_up_proj" in weights:
            i = cfg["moe_intermediate_size"]
            if name == "down_proj":
                return weights[p + "experts.down_proj"][e]
            both = weights[p + "experts.gate_up_proj"][e]
            return both[:i] if name == "gate_proj" else both[i:]
        return weights[f"{p}experts.{e}.{name}.weight"]

    def silu(a):
        return a * mx.sigmoid(a)

    rows = []
    for t in range(x.shape[0]):
        probs = mx.softmax((x[t] @ weights[p + "gate.weight"].T).astype(mx.float32))
        top = sorted(range(len(probs)), key=lambda e: -probs[e].item())[:k]
        w = [probs[e].item() for e in top]
        if cfg.get("norm_topk_prob", True):
            w = [v / sum(w) for v in w]
        y = mx.zeros(x.shape[1])
        for e, we in zip(top, w):
            h = silu(x[t] @ expert(e, "gate_proj").T) * (x[t] @ expert(e, "up_proj").T)
            y = y + we * (h @ expert(e, "down_proj").T)
        if p + "shared_expert_gate.weight" in weights:
            s = p + "shared_expert."
            h = silu(x[t] @ weights[s + "gate_proj.weight"].T) * (x[t] @ weights[s + "up_proj.weight"].T)
            gate = mx.sigmoid(x[t] @ weights[p + "shared_expert_gate.weight"].T)
            y = y + gate * (h @ weights[s + "down_proj.weight"].T)
        rows.append(y)
    return mx.stack(rows)


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen35_moe"])
@pytest.mark.parametrize("tokens", [5, 40])  # 10 picks: each row its experts; 80: sorted first
def test_moe_is_the_per_expert_loop(qwen3_moe, qwen35_moe, model, tokens):
    """moe() (gather products over the stacked experts) equals the loop over each token's chosen
    experts, in float32, on both paths (a few tokens; many, sorted by expert and put back)."""
    folder = qwen3_moe() if model == "qwen3_moe" else qwen35_moe()
    li.load_checked(folder)
    x = mx.random.normal((tokens, li.D), key=mx.random.key(tokens))
    for layer in li.MOE["layers"]:
        ours, loop = li.moe(x, layer), experts_loop(x, layer, folder)
        assert mx.abs(ours - loop).max().item() < 1e-5 * max(1, mx.abs(loop).max().item())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_qwen3_moe_logits_and_greedy_text_equal_mlx_lms(qwen3_moe, tokenizer, variant):
    """float32, 3 layers: mlx-lm's SwitchGLU and ours differ in summation order only (measured
    ~1e-6); a wrong renormalisation, a dense layer taken for a mixture or the experts' gate and
    up swapped give 1e-2 or more. The greedy ids agree too."""
    folder = qwen3_moe(**VARIANTS[variant])
    li.load_checked(folder)
    ids = tokenizer.encode(TEXT).ids
    ours, ref = li.forward(ids, [None] * li.N_LAYERS, 0), mlx_lm_logits(folder, ids)
    assert rel_err(ours, ref) < 1e-4, variant
    from test_model import mlx_lm_greedy
    greedy, _, _ = mlx_lm_greedy(folder, ids, 12)
    assert list(li.generate(ids, max_tokens=12)) == greedy[:len(list(li.generate(ids, 12)))]


def test_qwen35_moe_logits_equal_mlx_lms(qwen35_moe, tokenizer):
    folder = qwen35_moe()
    li.load_checked(folder)
    ids = tokenizer.encode(TEXT).ids
    assert rel_err(li.forward(ids, [None] * li.N_LAYERS, 0), mlx_lm_logits(folder, ids)) < 1e-4
    assert li.MOE["layers"] == list(range(li.N_LAYERS)) and "mtp.fc.weight" in li.W


def test_the_layers_that_hold_experts(qwen3_moe):
    """Qwen3-MoE's rule: not in mlp_only_layers, and (i + 1) a multiple of decoder_sparse_step;
    the others keep Step 6's dense MLP, intermediate_size wide."""
    for options, layers in [({}, [0, 1, 2]), (dict(mlp_only_layers=[1]), [0, 2]),
                            (dict(decoder_sparse_step=2), [1])]:
        li.load_checked(qwen3_moe(**options))
        assert li.MOE["layers"] == layers
        assert [f"model.layers.{i}.mlp.gate.weight" in li.W for i in range(3)] == \
            [i in layers for i in range(3)]
        assert all(f"model.layers.{i}.mlp.gate_proj.weight" in li.W for i in range(3)
                   if i not in layers)


def test_float32_logits_equal_transformers(qwen3_moe, qwen35_moe, tokenizer):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ids = tokenizer.encode(TEXT).ids
    for folder, cls in [(qwen3_moe(), "Qwen3MoeForCausalLM"),
                        (qwen3_moe(norm_topk_prob=False), "Qwen3MoeForCausalLM"),
                        (qwen35_moe(), "AutoModelForCausalLM")]:  # (its text model)
        model = getattr(transformers, cls).from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].numpy()
        li.load_checked(folder)
        ours = li.forward(ids, [None] * li.N_LAYERS, 0)
        assert rel_err(ours, mx.array(ref)) < 1e-4, cls  # float32: summation order (~1e-5)


def test_the_fixture_carries_the_released_tensor_names(qwen3_moe, tmp_path):
    """transformers' own Qwen3MoeForCausalLM, saved, writes the names (and shapes) our tiny
    Qwen3-MoE carries: one tensor an expert, the router as mlp.gate.weight."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = qwen3_moe()
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.save_pretrained(tmp_path / "saved")
    theirs = {k: v.shape for k, v in mx.load(str(tmp_path / "saved" / "model.safetensors")).items()}
    ours = {k: v.shape for k, v in mx.load(str(Path(folder) / "model.safetensors")).items()}
    assert theirs == ours


def test_a_4bit_conversion_with_its_8bit_router(qwen3_moe, qwen35_moe, tokenizer, tmp_path):
    """mlx_lm convert, 4 bits in groups of 32: switch_mlp.* stacked by MLX, the routers (and
    Qwen3.5's shared expert gates) 8-bit in groups of 64 through config.json's per-layer entries:
    ours equals mlx-lm's on the same packed weights (float32 activations, ~1e-6)."""
    from mlx_lm.convert import convert
    ids = tokenizer.encode(TEXT).ids
    for name, source in [("q3", qwen3_moe()), ("q35", qwen35_moe(mtp=False))]:
        out = tmp_path / name
        convert(str(source), str(out), quantize=True, q_group_size=32, q_bits=4)
        quant = json.loads((out / "config.json").read_text())["quantization"]
        assert any(isinstance(v, dict) and v["bits"] == 8 for v in quant.values())
        li.load_checked(out)
        assert li.W["model.layers.0.mlp.experts.gate_up_proj"].dtype == mx.uint32
        assert "model.layers.0.mlp.experts.gate_up_proj.scales" in li.W
        assert li.W["model.layers.0.mlp.gate.weight"].shape[-1] * 32 // li.D == 8  # 8 bits
        assert rel_err(li.forward(ids, [None] * li.N_LAYERS, 0), mlx_lm_logits(out, ids)) < 1e-4


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen35_moe"])
def test_a_4bit_conversion_that_leaves_narrow_experts_unquantised(qwen3_moe, qwen35_moe, tokenizer,
                                                                  tmp_path, model):
    """mlx_lm convert, 4 bits in groups of 64, of mixtures whose experts are 32 features wide
    (moe_intermediate_size 32): mlx-lm quantises a layer only where its input width is a multiple
    of the group (mlx_lm/utils.py, quantize_model(): `module.weight.shape[-1] % group_size != 0`
    -> not quantised), so each block's switch_mlp.down_proj (input 32) stays float32 beside its
    packed gate_proj and up_proj (input 64), and so does Qwen3.5's DeltaNet out_proj (input 4 x
    24 = 96). config.json names none of this: "quantization" holds the default (4 bits, groups
    of 64) and the routers' (and shared expert gates') 8-bit entries only; mlx-lm's loader
    quantises a layer where its .scales are stored (utils.py, _quantize()'s class_predicate).
    Ours runs the folder, and equals mlx-lm on the same weights: logits within 1e-4 (float32
    activations, the same packed products: summation order, measured ~1e-6 in
    test_a_4bit_conversion_with_its_8bit_router) and the same greedy tokens."""
    from mlx_lm.convert import convert
    from test_model import mlx_lm_greedy
    source = qwen3_moe() if model == "qwen3_moe" else qwen35_moe(mtp=False)
    out = tmp_path / "q4g64"
    convert(str(source), str(out), quantize=True, q_group_size=64, q_bits=4)
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert {k: quant[k] for k in ("group_size", "bits", "mode")} == {"group_size": 64, "bits": 4,
                                                                   "mode": "affine"}
    per_layer = {k: v for k, v in quant.items() if isinstance(v, dict)}
    assert per_layer and all(v == {"group_size": 64, "bits": 8} for v in per_layer.values())
    assert all(k.endswith(("mlp.gate", "mlp.shared_expert_gate")) for k in per_layer), per_layer
    stored = mx.load(str(out / "model.safetensors"))
    p = "model.layers.0.mlp.switch_mlp." if model == "qwen3_moe" else \
        "language_model.model.layers.0.mlp.switch_mlp."
    assert stored[p + "down_proj.weight"].dtype == mx.float32
    assert p + "down_proj.scales" not in stored
    assert stored[p + "gate_proj.weight"].dtype == mx.uint32 and p + "gate_proj.scales" in stored
    ids = tokenizer.encode(TEXT).ids
    li.load_checked(out)
    assert li.W["model.layers.0.mlp.experts.gate_up_proj"].dtype == mx.uint32
    assert li.W["model.layers.0.mlp.experts.down_proj"].shape == (8, 64, 32)  # as stored: whole
    assert rel_err(li.forward(ids, [None] * li.N_LAYERS, 0), mlx_lm_logits(out, ids)) < 1e-4
    greedy, _, _ = mlx_lm_greedy(out, ids, 12)
    assert list(li.generate(ids, max_tokens=12)) == greedy[:len(list(li.generate(ids, 12)))]
    r = run_cli("--model", str(out), "-m", "3")
    assert r.returncode == 0, r.stderr


def test_a_batch_is_each_row_alone(qwen3_moe, qwen35_moe, tokenizer):
    prompts = [tokenizer.encode(t).ids for t in ["The capital of France is", "Once upon a time",
                                                 "Emoji: 😀 👍🏽", TEXT]]
    for folder in (qwen3_moe(), qwen35_moe()):
        li.load_checked(folder)
        done = [[] for _ in prompts]
        for i, token in li.generate_batch(prompts, 10, batch_size=3):
            done[i].append(token)
        assert done == [list(li.generate(ids, max_tokens=10)) for ids in prompts]


@pytest.mark.parametrize("draft", ["mtp", "lookup"])
def test_drafting_on_qwen35_moe_gives_generates_ids(qwen35_moe, tokenizer, draft):
    """The MTP head's own layer is a mixture too (its experts one tensor each, as released)."""
    li.load_checked(qwen35_moe())
    assert "model.layers.4.mlp.experts.gate_up_proj" in li.W  # the MTP head's layer, stacked
    ids = tokenizer.encode(TEXT).ids
    drafter = li.MTPDrafter() if draft == "mtp" else li.PromptLookup()
    counts = {}
    ours = list(li.generate_draft(ids, max_tokens=16, drafter=drafter, counts=counts))
    assert ours == list(li.generate(ids, max_tokens=16)) and counts["drafted"] > 0


def test_bytes_per_token_count_the_k_experts_chosen(qwen3_moe):
    """A token reads its k of E experts a block, not all E: token_bytes() counts k/E of each
    stacked expert tensor, every other weight whole; a batch's rows each their own k at most."""
    li.load_checked(qwen3_moe())
    experts = sum(w.nbytes for name, w in li.W.items() if ".mlp.experts." in name)
    everything = sum(w.nbytes for name, w in li.W.items() if not name.startswith(
        "model.embed_tokens"))
    k, e = li.MOE["num_experts_per_tok"], li.MOE["num_experts"]
    assert li.token_bytes([], 0)[0] == pytest.approx(everything - experts + experts * k / e)
    assert li.token_bytes([], 0, rows=8)[0] == pytest.approx((everything - experts + experts) / 8)


def test_explain_shows_the_experts_at_work(qwen3_moe, tokenizer):
    """--explain on a mixture: for each MoE block, the k experts the prompt's last token chose,
    by weight, as the router gives them (computed here from the block's own input); and over the
    answer, how many experts each block used and its busiest three, their shares summing to at
    most 100%; every line within 80 columns."""
    folder = qwen3_moe()
    r = run_cli("--model", str(folder), "-m", "8", "--explain")
    assert r.returncode == 0, r.stderr
    view = r.stdout[r.stdout.index("the experts at work"):].splitlines()
    assert all(len(line) <= 80 for line in view), view
    li.load_checked(folder)
    ids = tokenizer.encode("The capital of France is").ids
    routes = []
    li.forward(ids, [None] * li.N_LAYERS, 0, routes=routes)
    for b, chosen, weights in routes:
        order = mx.argsort(-weights[-1]).tolist()
        shown = " ".join(f"#{chosen[-1, j].item()}:{100 * weights[-1, j].item():.0f}%" for j in order)
        assert f"block {b + 1}   {shown}" in "\n".join(view) or \
            re.search(rf"^block {b + 1} +{re.escape(shown)}$", "\n".join(view), re.M), (shown, view)
    spread = [line for line in view if " of 8 used; busiest" in line]
    assert len(spread) == 3
    for line in spread:
        shares = [int(s) for s in re.findall(r"#\d+ (\d+)%", line)]
        used = int(line.split()[2])
        assert 1 <= used <= 8 and len(shares) == min(3, used) and sum(shares) <= 100


def test_the_experts_view_keeps_to_80_columns_with_more_picks(monkeypatch):
    """Qwen3.5-397B-A17B's 10 of 512 experts a token: a block's picks go on under it, in order,
    no line over 80 columns."""
    monkeypatch.setattr(li, "MOE", {"num_experts_per_tok": 10, "num_experts": 512})
    chosen = mx.array([[500 + i for i in range(10)]] * 3)
    weights = mx.array([[0.19, 0.17, 0.15, 0.12, 0.1, 0.08, 0.07, 0.06, 0.04, 0.02]] * 3)
    lines = li.experts_at_work([(59, chosen, weights)], 0, range(0, 3))
    assert all(len(line) <= 80 for line in lines), lines
    picks = " ".join(f"#{500 + i}:{w}%" for i, w in enumerate([19, 17, 15, 12, 10, 8, 7, 6, 4, 2]))
    at = next(i for i, line in enumerate(lines) if line.startswith("block 60 "))
    assert lines[at + 1].startswith(" " * 9) and \
        " ".join(" ".join(lines[at:at + 2]).split()[2:]) == picks, lines


def test_load_holds_the_model_once(qwen3_moe, tmp_path):
    """Stacking the experts a block at a time: the peak while loading stays within the model's
    bytes and a block's experts twice (its tensors, then their stack), not two models; the model's
    line says that peak."""
    folder = qwen3_moe(num_experts=64, moe_intermediate_size=128, num_hidden_layers=6)
    mx.clear_cache()
    base = mx.get_active_memory()
    cfg = li.load_checked(folder)
    total = sum(w.nbytes for w in {id(w): w for w in li.W.values()}.values())
    block = sum(w.nbytes for name, w in li.W.items() if name.startswith("model.layers.0.mlp.experts."))
    peak = cfg["load_peak"] - base
    assert block * 5 < total  # a model of several blocks' experts: the bound below means something
    assert total < peak < total + 2 * block + 1e6, (peak, total, block)
    assert f", {cfg['load_peak'] / 1e9:.2f} GB at most while loading, float32" in li.summary(folder, cfg)


LOAD_TWICE = """
import json, sys
sys.path.insert(0, {root!r})
import llm_inference as li
folder = sys.argv[1]
first = li.load_checked(folder)
model = sum(w.nbytes for w in {{id(w): w for w in li.W.values()}}.values())  # (no array kept)
block = sum(w.nbytes for name, w in li.W.items() if name.startswith("model.layers.0.mlp.experts."))
second = li.load_checked(folder)  # the first model still held (li.W) until this one is in place
print(json.dumps({{"first": first["load_peak"], "second": second["load_peak"], "model": model,
                  "block": block, "line": li.summary(folder, second)}}))
"""


def test_a_second_load_does_not_count_the_first_model(qwen3_moe, tmp_path):
    """load_checked() twice in one process (a notebook's, a test run's): the second load's "at
    most while loading" (cfg["load_peak"], said on a mixture's model line) is its own, not it
    plus the first model's bytes (still held in li.W while the second is read). In a fresh
    process (nothing of MLX's held before the first load) the two loads read the same files
    through the same steps, so their figures agree but for the order in which MLX evaluates and
    frees the lazily read tensors: measured, the peak moves run to run in steps of one expert
    tensor (2.1 MB), up to 3 of them (a block's experts, 6.3 MB). The tolerance, 2 blocks'
    experts (12.6 MB), is twice that, and under half the slip's error: the first model, 38.8 MB
    (measured: 32 to 39 MB added)."""
    import subprocess
    import sys
    from test_cli_errors import ROOT
    folder = qwen3_moe(num_experts=64, moe_intermediate_size=128, num_hidden_layers=6)
    driver = tmp_path / "twice.py"
    driver.write_text(LOAD_TWICE.format(root=str(ROOT)))
    r = subprocess.run([sys.executable, str(driver), str(folder)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    first, second, model, block = got["first"], got["second"], got["model"], got["block"]
    print(f"first {first / 1e6:.1f} MB, second {second / 1e6:.1f} MB, model {model / 1e6:.1f} MB, "
          f"a block's experts {block / 1e6:.1f} MB")
    assert 6 * block < model  # 6 blocks and more: the tolerance is under half a model
    assert model <= first and model <= second  # each counts the model it reads
    assert abs(second - first) <= 2 * block, (second - first) / 1e6
    assert f", {second / 1e9:.2f} GB at most while loading" in got["line"]

REFUSALS = [
    (dict(norm_topk_prob=None), "config.json has no 'norm_topk_prob' entry"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok must be a whole number from 1 to num_experts"),
    (dict(mlp_only_layers=[5]), "mlp_only_layers must be a list of layer numbers"),
    (dict(n_group=4), "n_group is 4: this script does not run grouped routing"),
    (dict(scoring_func="sigmoid"), 'scoring_func is "sigmoid": this script does not run a router '
                                   "scored other than by a softmax"),
]


@pytest.mark.parametrize("change, words", REFUSALS)
def test_a_config_that_changes_the_math_is_one_line(qwen3_moe, tmp_path, change, words):
    folder = Path(shutil.copytree(qwen3_moe(), tmp_path / "m"))
    config = json.loads((folder / "config.json").read_text())
    for name, value in change.items():
        if value is None:
            del config[name]
        else:
            config[name] = value
    (folder / "config.json").write_text(json.dumps(config))
    assert_error(run_cli("--model", str(folder), "-m", "2"), words)


@pytest.mark.parametrize("fault", ["missing", "misshapen", "router bias", "switch_mlp"])
def test_a_missing_or_misshapen_expert_tensor_is_named(qwen3_moe, tmp_path, fault):
    folder = Path(shutil.copytree(qwen3_moe(), tmp_path / "m"))
    weights = mx.load(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    if fault == "missing":
        del weights[name]
    elif fault == "misshapen":
        weights[name] = weights[name][:-1]
    elif fault == "router bias":
        weights["model.layers.1.mlp.gate.bias"] = mx.zeros(8)
    else:  # block 1 in MLX's layout (switch_mlp.*, stacked), its down_proj left out
        for m in ("gate", "up", "down"):
            stacked = mx.stack([weights.pop(f"model.layers.1.mlp.experts.{n}.{m}_proj.weight")
                                for n in range(8)])
            if m != "down":
                weights[f"model.layers.1.mlp.switch_mlp.{m}_proj.weight"] = stacked
    from test_cli_errors import save_weights
    save_weights(folder / "model.safetensors", weights, metadata={"format": "pt"})
    r = run_cli("--model", str(folder), "-m", "2")
    words = {"missing": f"tensor {name} is missing in {folder}; expected shape (32, 64)",
             "misshapen": f"tensor {name} has shape (31, 64) in {folder}; expected shape (32, 64)",
             "router bias": "tensor model.layers.1.mlp.gate.bias in ",
             "switch_mlp": f"tensor model.layers.1.mlp.switch_mlp.down_proj.weight is missing in "
                           f"{folder}"}[fault]
    assert_error(r, words)
    if fault == "router bias":
        assert "this script does not run a router bias" in r.stderr


def test_qwen35_moe_without_renormalising_is_refused(qwen35_moe, tmp_path):
    folder = Path(shutil.copytree(qwen35_moe(), tmp_path / "m"))
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["norm_topk_prob"] = False
    (folder / "config.json").write_text(json.dumps(config))
    assert_error(run_cli("--model", str(folder), "-m", "2"), "norm_topk_prob is false: Qwen3.5-MoE")


def test_a_bfloat16_mixture_runs_on_this_device(qwen3_moe, tokenizer):
    """MLX's CPU gathers in float32 only (mlx-lm's own MoE cannot run a bfloat16 folder there):
    ours casts for the product, and its text is the float32 computation's but for bfloat16's
    roundings (its logits within bfloat16's steps of mlx-lm's run in float32)."""
    folder = qwen3_moe(dtype="bfloat16")
    li.load_checked(folder)
    ids = tokenizer.encode(TEXT).ids
    ours = li.forward(ids, [None] * li.N_LAYERS, 0)
    assert ours.dtype == mx.bfloat16
    assert rel_err(ours, mlx_lm_logits(folder, ids, mx.float32)) < 0.05
    r = run_cli("--model", str(folder), "-m", "4")
    assert r.returncode == 0 and "Qwen3-MoE from" in r.stdout, r.stderr


def test_the_router_softmax_is_float32_on_a_bfloat16_checkpoint(qwen3_moe):
    """bfloat16 activations, the router's logits bfloat16: its probabilities are still taken in
    float32, so each token's k weights are the float32 softmax's (renormalised), to float32's
    roundings (~1e-7), not bfloat16's (~4e-3, 2^-8 of a weight near 1). The reference here: the
    same logits, cast, then softmax, top k and renormalisation, all float32."""
    li.load_checked(qwen3_moe(dtype="bfloat16"))
    x = mx.random.normal((40, li.D), key=mx.random.key(1)).astype(mx.bfloat16)
    routes = []
    for layer in li.MOE["layers"]:
        li.moe(x, layer, routes)
    assert [b for b, _, _ in routes] == li.MOE["layers"]
    k = li.MOE["num_experts_per_tok"]
    for layer, chosen, weights in routes:
        logits = x @ li.W[f"model.layers.{layer}.mlp.gate.weight"].T     # (L, E) bfloat16
        probs = mx.softmax(logits.astype(mx.float32), axis=-1)           # the reference's float32
        top = mx.sort(probs, axis=-1)[:, -k:]
        ref = top / top.sum(axis=-1, keepdims=True)
        assert weights.dtype == mx.float32, weights.dtype
        ours = mx.sort(weights.astype(mx.float32), axis=-1)
        err = mx.abs(ours - ref).max().item()
        assert err < 1e-5, f"layer {layer}: router weights {err:.1e} off float32's"
        assert mx.array_equal(mx.sort(chosen, axis=-1), mx.sort(mx.argsort(probs, axis=-1)[:, -k:],
                                                                   axis=-1)).item(), layer


def test_experts_stack_in_numeric_order_past_ten(qwen3_moe, tokenizer):
    """12 experts, one tensor each as Hugging Face's Qwen3-MoE holds them: "experts.10" sorts
    before "experts.2" as text, so the stack must follow the numbers. moe() equals the loop that
    reads each expert by its own name (no stacking), and the logits mlx-lm's (its sanitize
    stacks them itself)."""
    folder = qwen3_moe(num_experts=12)
    li.load_checked(folder)
    assert li.W["model.layers.0.mlp.experts.down_proj"].shape[0] == 12
    x = mx.random.normal((40, li.D), key=mx.random.key(12))
    for layer in li.MOE["layers"]:
        ours, loop = li.moe(x, layer), experts_loop(x, layer, folder)
        assert mx.abs(ours - loop).max().item() < 1e-5 * max(1, mx.abs(loop).max().item()), layer
    ids = tokenizer.encode(TEXT).ids
    assert rel_err(li.forward(ids, [None] * li.N_LAYERS, 0), mlx_lm_logits(folder, ids)) < 1e-4
