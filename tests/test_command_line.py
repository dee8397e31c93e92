"""The command line (issue 35): --help shows every default, --quiet prints the completion alone,
every error comes before any output, and the statistics lines time what mlx_lm.generate times."""
import argparse
import re

import pytest

import llm_inference as li
from test_cli_errors import assert_error, run_cli, save_weights


def test_help_shows_every_flag_with_its_default(checkpoint):
    r = run_cli("--help")
    assert r.returncode == 0 and r.stderr == ""
    flags = re.findall(r"^  (--[\w-]+)", r.stdout, re.M)
    assert len(flags) == 26 and "--top-k" in flags and "--quiet" in flags
    text = " ".join(r.stdout.split())  # argparse wraps the help text
    options = text.split("options: ")[1]
    for flag, default in [("--max-tokens", "100"), ("--temperature", "0.0"), ("--top-p", "1.0"),
                          ("--top-k", "0"), ("--min-p", "0.0"), ("--batch-size", "8")]:
        after = options[options.index(f" {flag} "):]  # the flag's help, then its default
        assert re.search(r"\(default: ([^)]*)\)", after).group(1) == default, flag
    assert text.count("(default: ") == 26


def test_quiet_prints_the_completion_only(checkpoint):
    loud = run_cli("--model", str(checkpoint()), "-m", "5", "--prompt", "Once upon a time")
    quiet = run_cli("--model", str(checkpoint()), "-m", "5", "--prompt", "Once upon a time", "-q")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    completion = loud.stdout.split("==========\n")[1][len("Once upon a time"):]
    assert quiet.stdout == completion  # the completion and its newline, nothing else


def test_a_prompt_longer_than_the_context_prints_nothing_first(checkpoint, tokenizer):
    folder = checkpoint(max_position_embeddings=64)
    r = run_cli("--model", str(folder), "--prompt", "The capital of France is Paris. " * 20)
    assert_error(r, "tokens; the context holds 64")
    assert r.stdout == ""
    r = run_cli("--model", str(folder), "--chat", "--prompt", "The capital of France is Paris. " * 20)
    assert_error(r, "tokens; the context holds 64")
    assert r.stdout == ""


class Clock:
    """time.perf_counter for reply(): each reading one second after the last."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


def test_the_statistics_time_the_prompt_to_its_first_token(checkpoint, tokenizer, monkeypatch, capsys):
    """Prompt: its tokens over the time to the first token; Generation: every token, the first
    too, over the time from the first to the end (mlx-lm's rates). With a clock that reads 1 s
    later each time: the prompt read at t=1, the first token at t=2, the end at t=3."""
    li.load(checkpoint())
    ids = tokenizer.encode("Once upon a time").ids
    args = argparse.Namespace(max_tokens=6, explain=False, show_probs=0, draft=None, quiet=False,
                              temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    monkeypatch.setattr(li.time, "perf_counter", Clock())
    generated = li.reply(ids, args, [None] * li.N_LAYERS)
    out = capsys.readouterr().out
    assert len(generated) > 2  # (a first token, and more than one after it)
    assert f"Prompt: {len(ids)} tokens, {len(ids) / 1:.3f} tokens-per-sec" in out
    assert f"Generation: {len(generated)} tokens, {len(generated) / 1:.3f} tokens-per-sec" in out


def test_the_generation_rate_counts_every_token(checkpoint, tokenizer, monkeypatch, capsys):
    """print_stats() alone, its clock fixed at the end: n tokens over the time from the first
    token to the end, as mlx-lm counts (n, not n - 1); the bytes-per-token line's GB/s at that
    same rate. The times are exact in binary: 8 tokens over 2**-10 s are 8192 tokens-per-sec."""
    li.load(checkpoint())
    ids = tokenizer.encode("Once upon a time").ids
    cache = [None] * li.N_LAYERS
    generated = list(li.generate(ids, max_tokens=8, cache=cache))
    n, held = len(generated), len(ids)
    assert n == 8
    tic, t_first, t_end = 0.0, 1.0, 1.0 + 2**-10
    monkeypatch.setattr(li.time, "perf_counter", lambda: t_end)
    returned = li.print_stats(held, n, tic, t_first, cache, held)
    out = capsys.readouterr().out
    rate = n / (t_end - t_first)
    assert rate == 8192.0
    assert f"Prompt: {held} tokens, {held / (t_first - tic):.3f} tokens-per-sec" in out
    assert f"Generation: {n} tokens, {rate:.3f} tokens-per-sec\n" in out, out
    weights, memory = li.token_bytes(cache, held + n)
    assert (f"Bytes per token: {weights / 1e6:.3f} MB of weights + {memory / 1e6:.3f} MB of cache, "
            f"{(weights + memory) * rate / 1e9:.3f} GB/s at {rate:.3f} tokens-per-sec") in out, out
    assert returned == (weights + memory) * rate  # the bytes a second, for --explain's share

def test_one_logit_that_is_not_finite_stops_before_any_text(checkpoint, tokenizer, tmp_path):
    """One row of lm_head built to overflow float16 after this prompt (60000 x the sign of each
    hidden number, itself a float16 value): one logit is inf, the others finite. The run says
    so before any text: a single such logit is enough."""
    import mlx.core as mx
    import shutil
    folder = shutil.copytree(checkpoint(), tmp_path / "model")
    li.load(folder)
    ids = tokenizer.encode("Once upon a time").ids
    hidden = []
    li.forward(ids, [None] * li.N_LAYERS, 0, hidden)
    h = li.rms_norm(hidden[-1][-1], li.W["model.norm.weight"], li.EPS)
    weights = mx.load(str(folder / "model.safetensors"))
    weights["lm_head.weight"][7] = 60000 * mx.sign(h)
    save_weights(folder / "model.safetensors", weights, metadata={"format": "pt"})
    r = run_cli("--model", str(folder), "--prompt", "Once upon a time", "--dtype", "float16")
    assert_error(r, "not finite")
    assert "==========" not in r.stdout
    assert run_cli("--model", str(folder), "--prompt", "Once upon a time").returncode == 0


def test_drafting_counts_the_models_passes(checkpoint, tokenizer, monkeypatch, capsys):
    """Under --draft a pass of the model serves 1 + its accepted drafts: the bytes line says what
    a pass reads, the tokens a pass, and from them what a token reads and the GB/s at the rate
    (counting a pass a token would overstate both). The clock fixed as above."""
    li.load(checkpoint())
    ids = tokenizer.encode("1 2 3 1 2 3 1 2 3 1 2").ids
    cache, counts = [None] * li.N_LAYERS, {}
    generated = list(li.generate_draft(ids, max_tokens=12, drafter=li.PromptLookup(3),
                                       cache=cache, counts=counts))
    n, held, passes = len(generated), len(ids), counts["passes"]
    assert n == 12 and counts["accepted"] > 0 and passes == n - counts["accepted"]
    monkeypatch.setattr(li.time, "perf_counter", lambda: 1.0 + 2**-10)
    returned = li.print_stats(held, n, 0.0, 1.0, cache, held, passes)
    out = capsys.readouterr().out
    rate, per_pass = n * 2**10, n / passes
    weights, memory = li.token_bytes(cache, held + n)
    read = (weights + memory) / per_pass
    assert (f"Bytes per token: {weights / 1e6:.3f} MB of weights + {memory / 1e6:.3f} MB of cache "
            f"a pass, {per_pass:.2f} tokens a pass: {read / 1e6:.3f} MB a token, "
            f"{read * rate / 1e9:.3f} GB/s at {rate:.3f} tokens-per-sec") in out, out
    assert returned == read * rate


def test_the_mtp_heads_drafting_is_read_each_pass(qwen35):
    """--draft mtp: each pass also reads the MTP head's own layer and the LM head once more (its
    logits); token_bytes() counts them when asked, each tensor once."""
    li.load(qwen35(mtp="agree"))
    plain, _ = li.token_bytes([], 0)
    drafting, _ = li.token_bytes([], 0, mtp=True)
    own = {id(w): w for name, w in li.W.items() if name.startswith("mtp.")}
    assert own and drafting - plain == sum(w.nbytes for w in own.values()) + \
        li.W["lm_head.weight"].nbytes


@pytest.mark.parametrize("shows", ["explain", "show_probs"])
def test_the_prompt_clock_leaves_out_what_explain_and_show_probs_do(checkpoint, tokenizer,
                                                                    monkeypatch, capsys, shows):
    """--explain's and --show-probs' own work (here: 100 s on the clock) happens before the first
    token but is not the prompt's: the Prompt rate's clock leaves it out."""
    li.load(checkpoint())
    ids = tokenizer.encode("Once upon a time").ids
    clock = Clock()

    def slow_view(*args):
        clock.now += 100
        return [(0, 1.0)]

    monkeypatch.setattr(li.time, "perf_counter", clock)
    monkeypatch.setattr(li, "explain" if shows == "explain" else "top_tokens", slow_view)
    monkeypatch.setattr(li, "bandwidth", lambda: 1e12)
    monkeypatch.setattr(li, "answer_forming", lambda *args: None)
    args = argparse.Namespace(max_tokens=3, explain=shows == "explain", draft=None, quiet=False,
                              show_probs=2 if shows == "show_probs" else 0, temperature=0.0,
                              top_p=1.0, top_k=0, min_p=0.0, chat=False, lens_tokens=64)
    li.reply(ids, args, [None] * li.N_LAYERS)
    rate = float(re.search(r"Prompt: \d+ tokens, ([\d.]+) tokens-per-sec", capsys.readouterr().out)[1])
    assert len(ids) / rate < 10  # seconds: the prompt's own, not the 100 s


def test_help_gives_lens_tokens_default_and_rms_norms_docstring_its_own(checkpoint):
    """--help says --lens-tokens' default (64, not None); rms_norm()'s docstring says the default
    its signature has."""
    import inspect
    text = " ".join(run_cli("--help").stdout.split())
    after = text[text.index(" --lens-tokens N "):]
    assert re.search(r"\(default: ([^)]*)\)", after).group(1) == "64"
    default = inspect.signature(li.rms_norm).parameters["eps"].default
    assert float(re.search(r"eps: ([\de.-]+),", li.rms_norm.__doc__)[1]) == default == 1e-6
