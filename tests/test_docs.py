"""The documentation's links lead somewhere: every relative link and image in README.md and the
pages under docs/ (and the examples' READMEs) names a file of the repository, and every #anchor a
heading of that file, spelled as GitHub spells it. CI runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("README.md")])
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans (links there are not links)."""
    return CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text of its links and code, lower case, punctuation
    dropped (letters, digits, ``_`` and ``-`` stay, in any script), spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_slugs_are_githubs():
    assert slug("The α convention") == "the-α-convention"
    assert slug("Claims check (experiments.md, \"Claims\")") == "claims-check-experimentsmd-claims"
    assert slug("1. From Python: `run_on_flower`") == "1-from-python-run_on_flower"
    assert slug("Secure setup (TLS and SuperNode authentication)") == "secure-setup-tls-and-supernode-authentication"
    assert slug("Flower's runtimes") == "flowers-runtimes"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[ok](#top) [gone](#nowhere) [file](missing.md) `[code](x.md)`\n"
                    "```\n[fenced](y.md)\n```\n[web](https://example.org/x)\n")
    assert links(page) == ["#top", "#nowhere", "missing.md"]
    assert anchors(page) == {"top"}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
        elif not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_ci_runs_the_readmes_test_command():
    """The README opens with its two commands; .ci/run runs the second one as it is written."""
    readme = (ROOT / "README.md").read_text()
    block = re.match(r"# [^\n]*\n\n```bash\n(.*?)```", readme, re.S)
    assert block, "README.md must open with its commands"
    commands = [line for line in block.group(1).splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and all(c.startswith("python3 -m venv .venv && ") for c in commands)
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()
