"""Every commit id the docs and the README cite (a 7-40 digit hex word with a letter and a digit in
it) is a commit of this repository's history, so a figure's "code <id>" can be checked out."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A hex word with at least one digit and one letter: commit ids, not plain numbers or words.
COMMIT_ID = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def cited_ids() -> dict[str, set[str]]:
    """Each cited id and the files that cite it (docs/**/*.md and README.md)."""
    found: dict[str, set[str]] = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in COMMIT_ID.finditer(page.read_text()):
            found.setdefault(match.group(0), set()).add(str(page.relative_to(ROOT)))
    return found


def missing_commits(ids: list[str]) -> list[str]:
    """The ids that name no commit here, asked of git in one `cat-file --batch-check`."""
    query = "".join(f"{i}^{{commit}}\n" for i in ids)
    out = subprocess.run(["git", "cat-file", "--batch-check"], input=query, text=True,
                         capture_output=True, cwd=ROOT, check=True, timeout=60).stdout
    return [i for i, line in zip(ids, out.splitlines()) if line.endswith("missing")]


def full_history() -> None:
    """The check needs the whole history: a shallow or absent clone would call real ids missing.
    CI clones main in full; a shallow checkout fails here with the fix rather than skipping."""
    out = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], check=False,
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, f"not a git checkout ({out.stderr.strip()}): clone the repository"
    assert out.stdout.strip() == "false", "shallow clone: run `git fetch --unshallow` first"


def test_every_cited_commit_exists():
    full_history()
    cited = cited_ids()
    assert len(cited) > 20  # the perf pages cite the code of their figures
    missing = missing_commits(sorted(cited))
    assert not missing, {i: sorted(cited[i]) for i in missing}


def test_a_made_up_id_is_reported_missing():
    full_history()
    real = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT, check=True, timeout=60).stdout.strip()
    assert missing_commits([real, "62b2410", "bcf73e3"]) == ["62b2410", "bcf73e3"]
    assert COMMIT_ID.findall("code 62b2410, 2148000 people, deadbeef, a 64-byte cafe01") == \
        ["62b2410"]
