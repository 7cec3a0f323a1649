"""The README stays a newcomer's page (issue 50: at most 200 lines, the rest in docs/), and every link in it leads
somewhere: a file of the tree, and a heading of it where the link names one."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#]+)(?:#([^)]+))?\)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail to docs/ and link it"


def test_every_link_in_the_readme_leads_to_a_file_and_heading_of_the_tree():
    text = (ROOT / "README.md").read_text()
    links = LINK.findall(text)
    assert links, "the README links docs/ (its detail lives there)"
    for target, fragment in links:
        if target.startswith(("http://", "https://")):
            continue
        path = ROOT / target
        assert path.exists(), f"README links {target}, which the tree does not have"
        if fragment:
            headings = {anchor(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}
            assert fragment in headings, f"README links {target}#{fragment}: no such heading there"
