"""The package's metadata as a package index shows it."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_long_description_has_no_relative_links():
    """A package index renders the long description without the repository around it, so a link
    to a repository file would break there; files are named as code paths instead."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    path = cfg["metadata"]["long_description"].removeprefix("file:").strip()
    text = (ROOT / path).read_text()
    targets = re.findall(r"\]\(([^)]*)\)", text) + re.findall(r"src=\"([^\"]*)\"", text)
    assert [t for t in targets if not re.match(r"https?://", t)] == []


def test_no_source_file_of_the_package_passes_700_lines():
    """The size limit of the house style: a module that grows past it is split by what it does
    (a newcomer reads the architecture from the folder tree)."""
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "specmeta").rglob("*"))
            if p.suffix in (".py", ".c") and (n := len(p.read_text().splitlines())) > 700}  # fmt: skip
    assert long == {}, f"over 700 lines: {long}"
