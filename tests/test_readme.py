"""The README is the reader's map of llm_inference.py: its links must land where they say."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_step_links_land_on_their_banners():
    """Each `[Step N](llm_inference.py#Lk)` link points at the banner of Step N, so that a reader
    with the article open goes from the README to any step's code in one jump; each other link
    at the banner of the part or section it names, the four parts among them."""
    readme = (ROOT / "README.md").read_text()
    lines = (ROOT / "llm_inference.py").read_text().splitlines()
    links = [(label, int(n)) for label, n in
             re.findall(r"\[([^\]]+)\]\(llm_inference\.py#L(\d+)\)", readme)]
    steps = [(label, n) for label, n in links if label.startswith("Step ")]
    assert [label for label, _ in steps] == [f"Step {i}" for i in range(1, 10)]
    for label, n in steps:
        assert lines[n - 1].startswith(f"# ═══ {label}. "), (label, n, lines[n - 1])
    for label, n in links:  # every link: a banner, a part's or a section's, of what it names
        assert lines[n - 1].startswith(("# ═══ ", "# ─── ")), (label, n, lines[n - 1])
        assert label.lower().split(",")[0] in lines[n - 1].lower(), (label, lines[n - 1])
    parts = [label for label, n in links if lines[n - 1].startswith("# ═══ Part ")]
    assert parts == ["Part I", "Part II", "Part III", "Part IV"]  # the four, in order


def test_the_readme_tiny_checkpoint_commands_run_as_written(tmp_path):
    """The "Try it without the 1.5 GB" commands, run as the README writes them (in a fresh
    folder, the script and tests/ beside them, as in a clone): a checkpoint, then a run of it."""
    import shutil
    import subprocess
    import sys
    readme = (ROOT / "README.md").read_text()
    block = readme.split("### Try it without the 1.5 GB")[1].split("```bash\n")[1].split("```")[0]
    commands = [line for line in block.splitlines() if line.startswith("python ")]
    assert len(commands) == 2 and "--model tiny" in commands[1]
    shutil.copy(ROOT / "llm_inference.py", tmp_path)
    shutil.copytree(ROOT / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for command in commands:
        r = subprocess.run(command.replace("python ", f"{sys.executable} ", 1), shell=True,
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith(f"Qwen3 from {tmp_path / 'tiny'}: 3 layers") and "block 3" in r.stdout


def statistics_labels(text):
    """The label (before its first ':') of each line after a run's second "==========" line."""
    after = text.split("==========\n")[2]
    return [line.split(":")[0] for line in after.splitlines() if line.strip()]


def test_the_readme_sample_run_shows_every_statistics_line(checkpoint):
    """The sample run under "What a good run prints" shows every statistics line a run
    prints, in its order: the labels of a run on the tiny checkpoint are the README's."""
    from test_cli_errors import run_cli
    r = run_cli("--model", str(checkpoint()), "-m", "3")
    assert r.returncode == 0, r.stderr
    printed = statistics_labels(r.stdout)
    assert printed[:2] == ["Prompt", "Generation"] and "Bytes per token" in printed
    readme = (ROOT / "README.md").read_text()
    sample = readme.split("## What a good run prints")[1].split("```\n")[1]
    assert sample.startswith("Qwen3 from ") and sample.count("==========\n") == 2, sample
    assert statistics_labels(sample) == printed


def test_the_readme_answer_forming_is_the_tiny_checkpoints(tmp_path):
    """The grid under "See inside" is what its command draws on the README's tiny checkpoint, cell
    for cell (a random model's noise, but this code's)."""
    import os
    import subprocess
    import sys
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## See inside")[1].split("```\n")[1]
    command = block.splitlines()[0].removeprefix("$ python ")
    assert command.startswith("llm_inference.py --model tiny --explain")
    subprocess.run([sys.executable, ROOT / "tests" / "random_checkpoint.py", "tiny", "--tiny"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=120)
    r = subprocess.run([sys.executable, ROOT / "llm_inference.py", *command.split()[1:]],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    drawn = r.stdout[r.stdout.index("the answer forming"):]
    shown = block[block.index("the answer forming"):]
    assert [line.rstrip() for line in drawn.splitlines()] == shown.splitlines()
