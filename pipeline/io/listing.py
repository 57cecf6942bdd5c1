"""Listing local trees: what is under a folder, and what a user's pattern matches (``pipeline.io.storage``
lists ``gs://`` and calls these for local paths).

Two kinds of path reach a listing, and they are never mixed up:

* a folder promptmill names (OUT, and everything under it): always a literal path, so
  an OUT called ``runs/o[7]`` is that folder, not a pattern (``entries``, ``files``);
  the pattern, if any, is relative to it;
* a user's ``--prompts`` pattern (``glob``): ``*``, ``?``, ``[..]`` and ``**``, unless
  the path names an existing file or folder as it stands.

Local trees are walked, never globbed, and every walk ends: a listing of OUT never
follows a symbolic link (a link is reported as one, so ``--overwrite`` can leave it and
say so), and a ``--prompts`` walk follows linked folders at most once each (a link
back into the tree is skipped) and takes each file once however many links reach it.
Names beginning with ``.`` are left out of every match unless the pattern names them,
as shell globs do (a ``naming.TEMP_PREFIX`` file is one).
"""
from __future__ import annotations

import os
import re
import stat
from typing import Iterator

WILDCARD = re.compile(r"[*?\[]")  # what makes a path a pattern


class NotAPromptFile(ValueError):
    """A ``--prompts`` path that names something other than a file or folder (a FIFO, a device)."""


def regex(pattern: str) -> re.Pattern:
    """A regex with the semantics of Python's recursive glob, for names relative to a folder.

    ``*`` and ``?`` stay within one path segment, ``[..]`` is a character class, and
    ``**/`` matches zero or more whole segments (``**`` at the end: anything). A segment
    that begins with a wildcard never matches a name beginning with ``.``.
    """
    out, i = [], 0
    while i < len(pattern):
        segment_start = i == 0 or pattern[i - 1] == "/"
        hidden = "(?!\\.)" if segment_start else ""
        if pattern.startswith("**/", i):
            out.append("(?:(?!\\.)[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(hidden + "(?:(?!\\.)[^/]*/)*(?!\\.)[^/]*")
            i += 2
        elif pattern[i] == "*":
            out.append(hidden + "[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append(hidden + "[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            out.append(hidden + "[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def entries(folder: str) -> Iterator[tuple[str, str]]:
    """``(path, kind)`` of everything under ``folder`` (a literal path), streamed in no set
    order; kind is "file", "link" (a symbolic link, never followed) or "other" (a FIFO, a
    socket, a device). Folders are entered, not listed; a missing folder lists nothing."""
    stack = [folder]
    while stack:
        try:
            with os.scandir(stack.pop()) as found:
                for entry in found:
                    if entry.is_symlink():
                        yield entry.path, "link"
                    elif entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        yield entry.path, "file"
                    else:
                        yield entry.path, "other"
        except (FileNotFoundError, NotADirectoryError):
            continue


def files(folder: str, pattern: str = "**") -> Iterator[str]:
    """Paths of the objects under ``folder`` (a literal path) whose name relative to it
    matches ``pattern`` (``regex``), streamed in no set order: regular files only, no
    link followed. ``sorted()`` them where order matters."""
    folder = folder.rstrip("/")
    matches = regex(pattern).match
    for path, kind in entries(folder):
        if kind == "file" and matches(path[len(folder) + 1:]):
            yield path


def glob(pattern: str) -> list[str]:
    """Sorted paths of the files a user's ``--prompts`` pattern names: the file or the
    files under the folder it names as it stands, else those matching it (``regex``).
    NotAPromptFile when it names something that is neither file nor folder."""
    if os.path.exists(pattern):
        mode = os.stat(pattern).st_mode
        if stat.S_ISREG(mode):
            return [pattern]
        if not stat.S_ISDIR(mode):
            raise NotAPromptFile(f"--prompts {pattern} is {_kind(mode)}, not a prompt file or a folder of them")
        return sorted(_walk_following(pattern.rstrip("/") or "/", regex("**")))
    match = WILDCARD.search(pattern)
    if not match:
        return []
    base = pattern[:match.start()].rpartition("/")[0]
    rest = pattern[len(base) + 1:] if base else pattern
    return sorted(_walk_following(base or ".", regex(rest), "" if base else "./"))


def _walk_following(root: str, matches: re.Pattern, drop: str = "") -> Iterator[str]:
    """Regular files under ``root`` whose relative name ``matches``, following linked
    folders: each folder (by device and inode) is entered once, so a link loop ends, and
    each file is taken once, by the first path that reaches it in name order."""
    seen_folders, seen_files = set(), set()
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            info = os.stat(folder)
        except OSError:
            continue
        if (info.st_dev, info.st_ino) in seen_folders:
            continue
        seen_folders.add((info.st_dev, info.st_ino))
        try:
            names = sorted(os.listdir(folder), reverse=True)
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            try:
                mode = os.stat(path).st_mode
            except OSError:  # a dangling link
                continue
            if stat.S_ISDIR(mode):
                stack.append(path)
            elif stat.S_ISREG(mode):
                relative = path[len(root) + 1:] if root != "." else path
                if matches.match(relative.removeprefix(drop)):
                    key = (os.stat(path).st_dev, os.stat(path).st_ino)
                    if key not in seen_files:
                        seen_files.add(key)
                        yield path[len(drop):] if drop and path.startswith(drop) else path


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"
