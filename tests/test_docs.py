"""The repository's documents are its own (style §16): no file points outside the repository,
and every ``design §N.M`` or ``style §N`` citation names a section that exists in
``docs/design.md`` or a rule that exists in ``docs/style.md``."""

from __future__ import annotations

import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest

from specmeta.launch import interpreter_problem

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
STYLE = ROOT / "docs" / "style.md"

# What must not appear: paths and names of documents that lived outside the repository, and the
# citation form that pointed at them. Spelled in parts so that this file does not match itself.
_UPPER_SPEC, _UPPER_STYLE = "SP" + "EC", "ST" + "YLE"
STALE = (
    "../" + "shared/",
    _UPPER_SPEC + ".md",
    _UPPER_STYLE + ".md",
    _UPPER_SPEC + " §",
    _UPPER_STYLE + " §",
)
# Sections of the design document that code has always cited; their numbers never change.
STABLE_SECTIONS = {"0", "1", "2", "2.1", "2.2", "2.3", "2.4", "2.5", "3", "3.1", "3.2", "3.3",
                   "3.4", "4", "5", "6"}  # fmt: skip

_HEADING = re.compile(r"^#{2,3}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)
_RULE = re.compile(r"^(\d+)\.\s+\*\*", re.MULTILINE)
# A citation opens with the document's name; the section numbers after it on the same line
# (``design §1, §3.1`` or ``design §1 / §2.3``) belong to it until another name opens one.
_TOKEN = re.compile(r"\b(design|style)(?:\.md)?\s*(?=§)|§(\d+(?:\.\d+)*)")


def _repo_files() -> list[pathlib.Path]:
    """Tracked and untracked-but-not-ignored files, or every file under the source folders when
    this is not a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT, capture_output=True, check=True, text=True,
        ).stdout  # fmt: skip
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for top in ("specmeta", "tests", "examples", "bench", "scripts", "docs", ".ci"):
            names += [str(p.relative_to(ROOT)) for p in (ROOT / top).rglob("*") if p.is_file()]
        names += ["README.md", "setup.cfg", "pyproject.toml"]
    paths = []
    for name in names:
        path = ROOT / name
        if ".git" in path.relative_to(ROOT).parts or "__pycache__" in path.parts:
            continue
        if path.is_file():
            paths.append(path)
    return paths


@functools.lru_cache(maxsize=1)
def _texts() -> dict[str, str]:
    texts = {}
    for path in _repo_files():
        try:
            texts[str(path.relative_to(ROOT))] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # plots and other binary files
    return texts


def _design_sections() -> set[str]:
    return set(_HEADING.findall(DESIGN.read_text(encoding="utf-8")))


def _style_rules() -> set[str]:
    return set(_RULE.findall(STYLE.read_text(encoding="utf-8")))


def citations(name: str, text: str) -> list[tuple[int, str, str | None]]:
    """``(line, section, document)`` of every ``§`` number in ``text``; ``document`` is
    ``"design"`` or ``"style"``, or ``None`` where no document name opens the citation (inside
    ``docs/design.md`` a bare ``§`` is the document itself)."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        doc = "design" if name == "docs/design.md" else None
        for m in _TOKEN.finditer(line):
            if m.group(1):
                doc = m.group(1)
            else:
                found.append((lineno, m.group(2), doc))
    return found


def test_design_keeps_its_section_numbers():
    missing = STABLE_SECTIONS - _design_sections()
    assert not missing, f"docs/design.md lost the sections {sorted(missing)} that code cites"


def test_no_pointer_outside_the_repository():
    bad = [
        f"{name}:{lineno}: {line.strip()}"
        for name, text in _texts().items()
        for lineno, line in enumerate(text.splitlines(), 1)
        if any(s in line for s in STALE)
    ]
    assert not bad, (
        "files cite documents outside the repository; cite docs/design.md as 'design §N' "
        "and docs/style.md as 'style §N' instead:\n" + "\n".join(bad)
    )


def test_every_citation_names_an_existing_section():
    known = {"design": _design_sections(), "style": _style_rules()}
    bad = []
    for name, text in _texts().items():
        for lineno, section, doc in citations(name, text):
            if doc is None:
                bad.append(f"{name}:{lineno}: §{section} names no document (write 'design §')")
            elif section not in known[doc]:
                bad.append(f"{name}:{lineno}: {doc} §{section} does not exist")
    assert not bad, "citations of missing sections:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "line, expected",
    [
        ("(design §1, §3.1, §3.4)", [("1", "design"), ("3.1", "design"), ("3.4", "design")]),
        ("docs/design.md §2.3 and style §9", [("2.3", "design"), ("9", "style")]),
        ("design §1 / §2.3 read directly", [("1", "design"), ("2.3", "design")]),
        ("a bare \u00a74", [("4", None)]),
        ("`design §N.M`", []),
    ],
)
def test_citation_parser(line, expected):
    assert [(s, d) for _, s, d in citations("x.py", line)] == expected


README = ROOT / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)#]+)(?:#[^)]*)?\)")


def test_readme_is_under_300_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < 300, f"README.md has {lines} lines; it is an integrator's page (< 300)"


def test_readme_links_name_files_that_exist():
    missing = [link for link in _LINK.findall(README.read_text(encoding="utf-8"))
               if not link.startswith("http") and not (ROOT / link).exists()]  # fmt: skip
    assert not missing, f"README.md links to missing files: {missing}"


def test_readme_names_only_public_names_that_exist():
    """Every ``specmeta.<name>`` the README names resolves, and every ``bind_<...>`` it names is
    a method or function of the package."""
    import specmeta

    text = README.read_text(encoding="utf-8")
    missing = [n for n in sorted(set(re.findall(r"\bspecmeta\.([A-Za-z_]\w*)", text)))
               if not hasattr(specmeta, n)]  # fmt: skip
    assert not missing, f"README.md names specmeta.{missing}, which do not exist"


@pytest.mark.skipif(interpreter_problem() is not None, reason=str(interpreter_problem()))
def test_readme_quickstart_runs():
    """The quickstart block runs as it stands (on the CPU, under the interpreter), in a fresh
    process, and checks its status word."""
    blocks = [b for lang, b in _FENCE.findall(README.read_text(encoding="utf-8")) if lang == "python"
              and "specmeta.SpecConfig" in b]  # fmt: skip
    assert blocks, "README.md has no quickstart block"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", blocks[0]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_readme_commands_are_the_ci_commands():
    """The two commands the README gives are the ones .ci/run runs."""
    text, ci = README.read_text(encoding="utf-8"), (ROOT / ".ci" / "run").read_text()
    assert "python3 -m pytest -q -n 2\n" in text and "python3 -m pytest -q -n 2\n" in ci
    assert "pip install torch==2.13.0" in text and "pip install torch==2.13.0" in ci
