"""The shell commands of README.md and the guides under docs/, as the tests read them.

Every fenced block names its language: ```bash holds commands, ```text what a command
prints (or a usage line), ```python code. A command runs in the suite as written unless its
block starts with a marker line: ``# needs a cloud`` (a bucket, a TPU slice, a cluster or a
project: the capitals are placeholders) or ``# takes minutes`` (benchmarks, and whole runs
beside the README's tour); the suite parses those with promptmill's own parser
(tests/test_docs.py). Which test runs each of the others is said in tests/test_docs.py.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex

from tests.conftest import ROOT

LANGUAGES = ("bash", "text", "python")
MARKERS = ("# needs a cloud", "# takes minutes")
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```$", re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Command:
    path: str  # relative to the repository
    line: int  # of the block's first line
    text: str  # continuation lines joined, the trailing comment kept
    marker: str | None  # one of MARKERS, or None: it runs as written
    section: str  # the heading of the README or guide section it is in

    def words(self) -> list[str]:
        """The command's words as the shell splits them, its comment left out."""
        return shlex.split(self.text, comments=True)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def doc_paths() -> list[str]:
    """README.md and every docs/*.md, relative to the repository."""
    return ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
                                  if name.endswith(".md"))


def read(path: str) -> str:
    return open(os.path.join(ROOT, path), encoding="utf-8").read()


def fences(text: str) -> list[tuple[str, str, int]]:
    """(language, body, line) of each fenced block of a markdown text."""
    return [(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 1) for m in _FENCE.finditer(text)]


def block_commands(path: str, text: str) -> list[Command]:
    """The commands of the ```bash blocks of one markdown file."""
    found = []
    for language, body, line in fences(text):
        if language != "bash":
            continue
        before = _FENCE.sub("", text[:_offset(text, line)])  # a comment in a block is no heading
        section = ([""] + re.findall(r"^#+ (.+)$", before, flags=re.M))[-1]
        lines = re.sub(r"\\\n\s*", " ", body).splitlines()
        marker = next((m for m in MARKERS if lines and lines[0].startswith(m)), None)
        for command in lines[1 if marker else 0:]:
            if command.strip() and not command.lstrip().startswith("#"):
                found.append(Command(path, line, command.strip(), marker, section))
    return found


def _offset(text: str, line: int) -> int:
    return len("\n".join(text.split("\n")[:line - 1]))


def commands() -> list[Command]:
    """Every command of README.md and the guides, in order."""
    return [command for path in doc_paths() for command in block_commands(path, read(path))]


def section(path: str, heading: str) -> list[Command]:
    """The commands of one section (its heading's text) of one file."""
    return [c for c in commands() if c.path == path and c.section == heading]


def tour() -> list[Command]:
    """The README's tour: a run into tour-out, then the commands that read it."""
    return section("README.md", "A five-minute tour")


def quick_start() -> list[Command]:
    """The README's two set-up commands: the demo and the tests, each from a fresh clone."""
    return section("README.md", "Quick start")
