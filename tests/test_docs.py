"""The repository holds every document it cites: a project document named in code, tests or text (`DESIGN.md`,
`docs/DESIGN.md`, `README.md`: capital names ending in .md) is a file of this repository, at the root or in docs/."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"(?<![\w/.-])((?:docs/)?[A-Z][A-Z_]*\.md)\b")


def _tracked_text_files():
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / name for name in names if name.endswith((".py", ".md", ".yaml", ".toml", "run"))]


def test_every_cited_document_is_in_the_repository():
    missing = {}
    for path in _tracked_text_files():
        for cited in CITED.findall(path.read_text(errors="replace")):
            if not ((ROOT / cited).is_file() or (ROOT / "docs" / cited).is_file()):
                missing.setdefault(cited, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"cited but not in the repository: {missing}"


def test_the_design_document_names_only_modules_that_exist():
    """docs/DESIGN.md's module map stays current: every `pkg/module.py` or `pkg/sub/` path it names exists."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    named = set(re.findall(r"`((?:bpt|patches|train|tests|configs)/[\w/]*(?:\.py|/))`", text))
    assert named, "docs/DESIGN.md names no module paths: the module map is missing"
    assert not [p for p in sorted(named) if not (ROOT / p).exists()], \
        f"docs/DESIGN.md names paths that do not exist: {[p for p in sorted(named) if not (ROOT / p).exists()]}"
