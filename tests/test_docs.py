"""The repository holds every document it cites, and the README and docs/ pages hold up: a project document named in
code, tests or text (`docs/DESIGN.md`, `README.md`, `docs/families.md`: capital names ending in .md, or any docs/
page) is a file of this repository; every relative link of the pages reaches a file (and a heading, with an anchor);
the README stays a five-minute read; every `python -m MODULE ...` command of their code blocks names a module that
exists and flags its own parser accepts (parsed only, nothing run)."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"(?<![\w/.-])((?:docs/)?[A-Z][A-Z_]*\.md|docs/[\w-]+\.md)\b")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250


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


# ---------------------------------------------------------------- the pages: links, length, commands

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _prose(text: str) -> str:
    return FENCE.sub("", text)


def _anchors(text: str):
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped, spaces to -, repeats -1..."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ +(.+?) *$", _prose(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def test_the_readme_is_a_five_minute_read():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to a docs/ page"


def test_every_relative_link_of_the_pages_reaches_a_file():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.is_file():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in set(_anchors(file.read_text())):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# Each command line interface's parsing step, called with a command's arguments: it parses and checks the flags and
# loads nothing. An entry named `main` builds its parser inside: it is stopped right after that parser has parsed.
PARSERS = {
    "train.qlora": "train.recipe.args:parse_args",  # the flags, the --config YAML and their checks
    "train.eval": "train.evaluation.eval:parse_args",
    "train.pretrain_tiny": "train.pretrain_tiny:parse_args",
    "bpt.bench": "bpt.bench.cli:main",
    "bpt.bench.plot": "bpt.bench.plot:main",
    "bpt.bench.gpu_wheels": "bpt.bench.gpu_wheels:main",
}
NOT_OURS = {"pip", "pytest"}  # their flags are theirs: only that the module is installed is checked


def _commands(page: Path):
    """(line, module, arguments) of every `python -m MODULE ...` in the page's shell code blocks. Under
    `accelerate launch` the launcher's own options (before `-m`) are not checked: the module's part is. A last
    argument `...` stands for the run's other flags and is dropped."""
    for lang, block in FENCE.findall(page.read_text()):
        if lang not in ("", "bash", "sh"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            starts = [i for i, w in enumerate(words) if w in ("python", "python3", "launch") or w.endswith("/python")]
            for start in starts:
                rest = words[start + 1:]
                rest = rest[:next((i for i, w in enumerate(rest) if w in ("&&", "||", ";", "|")), len(rest))]
                if "-m" not in rest:
                    continue
                module, *args = rest[rest.index("-m") + 1:]
                yield line.strip(), module, args[:-1] if args[-1:] == ["..."] else args


class _Parsed(Exception):
    pass


def _parse(module: str, args: list[str], monkeypatch) -> None:
    name, function = PARSERS[module].split(":")
    entry = getattr(importlib.import_module(name), function)
    if function != "main":
        entry(args)
        return
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        with pytest.raises(_Parsed):
            entry(args)


def test_every_command_of_the_pages_names_a_module_and_flags_that_exist(monkeypatch):
    from train.errors import UserError

    monkeypatch.chdir(ROOT)  # the commands run from the repository root
    found, wrong = [], []
    for page in PAGES:
        for line, module, args in _commands(page):
            found.append(module)
            where = f"{page.relative_to(ROOT)}: {line}"
            if importlib.util.find_spec(module) is None:
                wrong.append(f"{where}: no module {module}")
                continue
            wrong += [f"{where}: no file {word}" for word in shlex.split(line, comments=True)
                      if word.endswith(".yaml") and not (ROOT / word).is_file()]  # launch configs included
            if module in NOT_OURS:
                continue
            if module not in PARSERS:
                wrong.append(f"{where}: add {module}'s parsing step to PARSERS")
                continue
            try:
                _parse(module, args, monkeypatch)
            except (UserError, SystemExit, pytest.fail.Exception) as error:
                wrong.append(f"{where}: {type(error).__name__} {error}")
    assert {"train.qlora", "train.eval", "bpt.bench"} <= set(found), f"commands found: {sorted(set(found))}"
    assert not wrong, "\n".join(wrong)
