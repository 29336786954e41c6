"""Prose that points somewhere: every docstring `Tests:` line names test files that exist, and every `§X.Y`
reference names a notes file of the repository that has that section as a heading.

The bugs this catches: a module docstring that says `Tests: tests/test_parallel_dims.py` after the tests were
renamed or never written (four such lines existed); a `§2.3.5` that points at a spec outside the repository,
or at a section the notes do not have (24 such references existed). A reader who follows either finds nothing.

The rules, kept simple enough to state here:
* `Tests:` runs to the next blank line or the end of the docstring; every `tests/....py` token in it must exist
  (a `*` glob must match at least one file), and there must be at least one.
* `§` references resolve against the nearest notes name before them on the same line (`v4_notes`, `rl_notes`,
  with or without `docs/` and `.md`); in a markdown file a line that names none refers to that file's own
  headings; in a Python file a `§` that names no notes file is itself the error. Ranges (`§2.1-2.2`, `§1-3`,
  `§2.3.1-2`: the short end replaces the trailing parts of the start) check both ends.
Pure text, no imports of the project: well under a second.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTES = {"v4_notes": ROOT / "docs" / "v4_notes.md", "rl_notes": ROOT / "docs" / "rl_notes.md"}
TESTS_LINE_SOURCES = ["nanoflash/**/*.py", "train.py", "bench/*.py", "bench/*.sh", "scripts/*.py", "scripts/*.sh",
                      "instruments/*.py", "experiments/**/*.py", "experiments/**/*.sh"]
SECTION_SOURCES = TESTS_LINE_SOURCES + ["tests/*.py", "README.md", "docs/*.md", "nanoflash/**/*.md", "tests/*.md"]

TESTS_BLOCK = re.compile(r"Tests:(.*?)(?:\n\s*\n|\"\"\"|$)", re.S)
TEST_PATH = re.compile(r"(?:tests|experiments)/[\w*./-]+?\.py")
NOTES_NAME = re.compile(r"\b(v4_notes|rl_notes)(?:\.md)?")
SECTION = re.compile(r"§\s*(\d+(?:\.\d+)*)(?:\s*-\s*(\d+(?:\.\d+)*))?")
HEADING = re.compile(r"^#+\s+(\d+(?:\.\d+)*)\.?\s", re.M)


def _files(patterns: list[str]) -> list[Path]:
    """The repository files the patterns match, sorted, without duplicates."""
    return sorted({p for pat in patterns for p in ROOT.glob(pat) if p.is_file()})


def stale_tests_lines(text: str, where: str) -> list[str]:
    """One message per `Tests:` block of `text` that names nothing, or names a file that does not exist."""
    errors = []
    for block in TESTS_BLOCK.findall(text):
        paths = TEST_PATH.findall(block)
        if not paths:
            errors.append(f"{where}: 'Tests:{block[:60]}' names no tests/....py file")
        errors += [f"{where}: Tests: names {p}, which does not exist" for p in paths if not list(ROOT.glob(p))]
    return errors


def headings(path: Path) -> set[str]:
    """The section numbers of a markdown file's headings (`## 2.` -> "2", `#### 2.3.1 ...` -> "2.3.1")."""
    return set(HEADING.findall(path.read_text())) if path.exists() else set()


def _range_ends(start: str, end: str | None) -> list[str]:
    """`2.3.1`-`2` -> [2.3.1, 2.3.2]; `2.1`-`2.2` -> both; `1`-`3` -> both; no end -> [start]."""
    if end is None:
        return [start]
    head = start.split(".")[: max(0, start.count(".") + 1 - (end.count(".") + 1))]
    return [start, ".".join(head + end.split("."))]


def unresolved_sections(text: str, where: str, own: set[str] | None) -> list[str]:
    """One message per `§` reference of `text` that names no notes file or a section its file lacks.
    `own`: the headings a bare reference resolves against (markdown), or None (Python: bare is an error)."""
    errors, cache = [], {}
    for n, line in enumerate(text.splitlines(), 1):
        for m in SECTION.finditer(line):
            names = NOTES_NAME.findall(line[: m.start()])
            if names:
                target = cache.setdefault(names[-1], headings(NOTES[names[-1]]))
                label = f"docs/{names[-1]}.md"
            elif own is not None:
                target, label = own, "this file"
            else:
                errors.append(f"{where}:{n}: {m.group(0)} names no notes file (v4_notes / rl_notes)")
                continue
            errors += [f"{where}:{n}: §{s} is not a heading of {label}"
                       for s in _range_ends(m.group(1), m.group(2)) if s not in target]
    return errors


def test_every_tests_line_names_files_that_exist():
    errors = []
    for path in _files(TESTS_LINE_SOURCES):
        errors += stale_tests_lines(path.read_text(), str(path.relative_to(ROOT)))
    assert not errors, "\n".join(errors)


def test_every_section_reference_resolves_inside_the_repo():
    assert all(p.exists() for p in NOTES.values()), "the notes files are missing"
    errors = []
    for path in _files(SECTION_SOURCES):
        if path == Path(__file__).resolve():
            continue  # this file's examples of bad references
        own = headings(path) if path.suffix == ".md" else None
        errors += unresolved_sections(path.read_text(), str(path.relative_to(ROOT)), own)
    assert not errors, "\n".join(errors)


def test_the_checkers_catch_what_they_claim():
    """The checkers themselves: each planted defect is reported, each good reference is not."""
    assert stale_tests_lines('"""x.\nTests: `pytest tests/test_docs_refs.py -q`.\n"""', "ok") == []
    assert len(stale_tests_lines("Tests: `pytest tests/test_no_such_file.py`.\n\n", "bad")) == 1
    assert len(stale_tests_lines("Tests: see the e2e test.\n\n", "vague")) == 1
    assert stale_tests_lines("Tests: `pytest tests/test_parallel_*.py -q`.\n\n", "glob") == []
    v4 = headings(NOTES["v4_notes"])
    assert {"2", "2.3", "2.3.5"} <= v4
    assert unresolved_sections("(v4_notes §2.3.5, §2.3.1-2)", "ok", None) == []
    assert len(unresolved_sections("(v4_notes §2.3.77)", "missing", None)) == 1
    assert len(unresolved_sections("(spec §2.3.5)", "unnamed", None)) == 1
    assert len(unresolved_sections("see §9", "md", {"1", "2"})) == 1
    assert _range_ends("2.3.1", "2") == ["2.3.1", "2.3.2"] and _range_ends("1", "3") == ["1", "3"]


def test_the_readme_reading_order_names_every_module():
    """The bug: a module (rl/actor.py and rl/rollouts.py were) or a package missing from the README's reading order,
    so a reader following it never meets half of the loop."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## Reading order", 1)[1].split("\n## ", 1)[0]
    pkg = ROOT / "nanoflash"
    wanted = [f"{p.name}" for p in pkg.glob("*.py") if p.name != "__init__.py"]
    wanted += [f"nanoflash/{d.name}/" for d in pkg.iterdir() if (d / "__init__.py").exists()]
    missing = [w for w in wanted if w not in table]
    assert not missing, f"README's reading order does not name {missing}"
