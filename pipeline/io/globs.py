"""Glob patterns as regular expressions over object names (a pure function).

GCS has no folders and no glob of its own that behaves as Python's does, so the storage
layer lists a pattern's longest literal prefix and keeps the names that this regex matches
(``pipeline.io.storage.glob``).
"""
from __future__ import annotations

import re


def glob_regex(pattern: str) -> re.Pattern:
    """A regex with the semantics of Python's recursive glob, for object names.

    ``*`` and ``?`` stay within one path segment, ``[..]`` is a character class, and
    ``**/`` matches zero or more whole segments (``**`` at the end: anything).
    """
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")
