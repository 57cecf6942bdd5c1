"""The compile cache's folders: local or ``gs://`` (mirrored into a local folder), made
private and checked before anything is read from them, and entries written whole."""
from __future__ import annotations

import os
import stat
import tempfile

from pipeline.core import logs

EXECUTABLES = "executables"  # the per-host executables' folder, inside the cache folder
CHECKS = "checks"  # results of programs compiled for other machines (the TPU check), by index key
CHECKS_FOLDER = "PROMPTMILL_CHECKS_FOLDER"  # a compiling child's parent's ``checks_folder``
INDEX = "index"  # inside EXECUTABLES: what a program is made of -> its executable's key


class UnsafeCacheFolder(PermissionError):
    """A local cache folder that someone other than this user could write."""


def resolve(directory: str) -> str:
    """The folder jax should use for ``--compile-cache``, or ValueError.

    A local folder is made absolute, so every host process of a local run shares it
    whatever its working directory. A ``gs://`` folder is kept as it is: ``enable``
    mirrors it into a local folder (jax itself would need gcsfs or TensorFlow for it).
    """
    if not directory:
        raise ValueError("--compile-cache needs a folder")
    if "://" not in directory:
        return os.path.abspath(os.path.expanduser(directory))
    if not directory.startswith("gs://"):
        raise ValueError(f"--compile-cache must be a local folder or gs:// path, got {directory!r}")
    return directory.rstrip("/")


def local_default() -> str:
    """The cache folder of local ``promptmill run``s that name none: under the promptmill
    cache folder, so a second local run of the same job is warm."""
    from pipeline.model.loading.cache import cache_dir

    return os.path.join(cache_dir(), "compile-cache", "local")


_REMOTE: dict[str, str] = {}  # gs:// cache folder -> its local mirror, for ``push``


def _mirror(remote: str) -> str:
    import hashlib

    from pipeline.model.loading.cache import cache_dir

    return os.path.join(cache_dir(), "compile-cache", hashlib.sha256(remote.encode()).hexdigest()[:16])


def pull(remote: str) -> str:
    """Copy a gs:// cache folder's entries into its local mirror; returns the mirror (a
    private local folder, ``private_folder``)."""
    from pipeline.io import storage

    local = private_folder(_mirror(remote))
    for path in sorted(storage.files(remote, "*")):
        target = os.path.join(local, path.rsplit("/", 1)[-1])
        if not os.path.exists(target):
            storage.download(path, target)
            os.chmod(target, 0o600)
    _REMOTE[remote] = local
    return local


def push() -> int:
    """Upload the entries this process added to a gs:// cache folder; returns how many.

    Entries are uploaded whole under their final names; two hosts writing the same
    entry write a valid executable either way.
    """
    from pipeline.io import storage

    uploaded = 0
    for remote, local in _REMOTE.items():
        present = {path.rsplit("/", 1)[-1] for path in sorted(storage.files(remote, "*"))}
        for name in sorted(os.listdir(local)):
            if name not in present and os.path.isfile(os.path.join(local, name)):
                with open(os.path.join(local, name), "rb") as f:
                    storage.write_bytes(f"{remote}/{name}", f.read())
                uploaded += 1
    return uploaded


def check_private(folder: str) -> str:
    """``folder`` if it is a folder that only this user can write; else UnsafeCacheFolder,
    naming it. Whoever can write a cache folder can change what the devices compute (an
    executable is machine code), so a folder another user owns is refused, as ssh refuses
    a group-writable ``~/.ssh``; one of this user's that its group or others can write (an
    earlier version made them under umask 002) is made private (0700) and said. Anything
    in it but regular files and folders (a FIFO would hang the first read) is refused."""
    info = os.stat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeCacheFolder(f"refusing the compile cache folder {folder}: it is not a folder; choose a folder")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise UnsafeCacheFolder(
            f"refusing the compile cache folder {folder}: it is owned by another user (uid {info.st_uid}, this "
            f"process runs as {os.getuid()}). Whoever can write it can change what the devices compute; have it "
            f"made this user's (chown {os.getuid()} {folder}) or choose another folder")
    if info.st_mode & 0o022:
        os.chmod(folder, 0o700)
        logs.event("cache_folder_tightened", folder=folder, mode_was=f"{stat.S_IMODE(info.st_mode):04o}", mode="0700",
                   why="its group or others could write it, and so change what the devices compute")
    odd = [entry.name for entry in os.scandir(folder)
           if not (entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False))]
    if odd:
        raise UnsafeCacheFolder(f"refusing the compile cache folder {folder}: it holds what is neither a file nor a "
                                f"folder ({', '.join(sorted(odd)[:5])}), which promptmill never writes there; remove "
                                f"it or choose another folder")
    return folder


def private_folder(folder: str) -> str:
    """``folder``, made if missing (it and any missing folder above it: 0700), and checked
    (``check_private``); returns it."""
    missing = []
    path = os.path.abspath(folder)
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # another host process of this run made it meanwhile
            continue
        os.chmod(path, 0o700)  # as asked, whatever the umask
    return check_private(folder)


def check_before_run(directory: str) -> str:
    """The folder of ``--compile-cache`` (``resolve``), a local one made and checked
    (``private_folder``) by the launcher, so a folder the hosts would refuse is refused
    before anything is planned."""
    path = resolve(directory)
    if "://" not in path:
        private_folder(path)
        for folder in (EXECUTABLES, os.path.join(EXECUTABLES, INDEX), CHECKS):
            check_existing(os.path.join(path, folder))
    return path


def check_existing(folder: str) -> None:
    """``check_private`` of a local ``folder`` that exists (a gs:// one is the bucket's
    permissions' business)."""
    if "://" not in folder and os.path.isdir(folder):
        check_private(folder)



def write_whole(path: str, data: bytes) -> None:
    """A whole entry under its final name. A local one is written private (0600, in a
    ``private_folder``) and renamed into place, so a host reading it meanwhile never sees
    half of it; a GCS object is uploaded whole."""
    from pipeline.io import storage

    if storage.is_gcs(path):
        storage.write_bytes(path, data)
        return
    folder = private_folder(os.path.dirname(path))
    fd, scratch = tempfile.mkstemp(prefix=".entry-", dir=folder)
    try:
        os.fchmod(fd, 0o600)  # mkstemp's mode already; said here, as the cache's rule
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(scratch, path)
    finally:
        if os.path.exists(scratch):
            os.remove(scratch)
