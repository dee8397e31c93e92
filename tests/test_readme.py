"""The README is the reader's map of llm_inference.py: its links must land where they say."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_step_links_land_on_their_banners():
    """Each `[Step N](llm_inference.py#Lk)` link points at the banner of Step N, so that a reader
    with the article open goes from the README to any step's code in one jump."""
    readme = (ROOT / "README.md").read_text()
    lines = (ROOT / "llm_inference.py").read_text().splitlines()
    links = [(label, int(n)) for label, n in
             re.findall(r"\[([^\]]+)\]\(llm_inference\.py#L(\d+)\)", readme)]
    steps = [(label, n) for label, n in links if label.startswith("Step ")]
    assert [label for label, _ in steps] == [f"Step {i}" for i in range(1, 10)]
    for label, n in steps:
        assert lines[n - 1].startswith(f"# ═══ {label}. "), (label, n, lines[n - 1])
    for label, n in links:
        assert lines[n - 1].startswith("# ═══ "), (label, n, lines[n - 1])  # every link: a banner
