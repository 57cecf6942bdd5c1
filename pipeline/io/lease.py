"""The lease on an OUT: one run at a time writes there.

Two launchers on one OUT would mix two runs (a second one's ``--overwrite`` deletes the
first's run while the first one's hosts go on committing), so every command that writes
a run (``run``, ``plan``, ``collect``, ``submit``) holds ``OUT/lease.json`` while it
works, and the hosts of the run renew it as they generate. A second command, with
``--overwrite`` or not, is refused while a live lease stands, naming who holds it.

A lease names its owner (a fresh id per command; hosts renew their launcher's, passed in
``OWNER_ENV``), the machine and the processes that hold it, and an expiry that holders
push forward every ``RENEW_S``. It is live until it expires, except that a lease held
only from this machine is over as soon as none of its processes is alive (a launcher
and hosts killed with -9 do not block the resume for ``LEASE_S``). A crashed run's lease
thus lapses, and ``--overwrite`` or a resume takes over after it. A holder that finds
the lease taken by another owner has lost it and stops before writing more.

Writes are conditional (a GCS generation precondition; locally a file linked into place),
so two commands that start at the same instant cannot both take a free lease.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
import uuid

from pipeline.core import logs, naming
from pipeline.io import storage

LEASE_S = 120.0  # how long a lease stands without a renewal
RENEW_S = 20.0  # how often a holder renews it
SUBMITTED_S = 6 * 3600.0  # a submitted run's, until its hosts start and renew it (a TPU pod's queue)
OWNER_ENV = "PROMPTMILL_LEASE_OWNER"  # the owner whose lease a host renews


class LeaseHeld(RuntimeError):
    """Another command holds the OUT."""


class LeaseLost(RuntimeError):
    """The lease this process held was taken by another owner (it had lapsed)."""


@dataclasses.dataclass(frozen=True)
class Lease:
    owner: str
    command: str  # what holds it, for people: "promptmill run", "promptmill submit gke"
    machine: str  # hostname and boot id: pids mean something only there
    pids: tuple[tuple[int, int], ...]  # (pid, start time in clock ticks) of its processes on ``machine``
    expires: float  # unix seconds
    # a submitted job's, renewed by hosts elsewhere (GKE): liveness is the expiry alone
    remote: bool = False

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Lease":
        found = json.loads(data)
        return cls(found["owner"], found["command"], found["machine"], tuple(map(tuple, found["pids"])),
                   float(found["expires"]), bool(found.get("remote", False)))

    def live(self, now: float) -> bool:
        """Whether it still holds OUT at ``now``: unexpired, and, when held from this machine
        alone, with one of its processes alive."""
        if now >= self.expires:
            return False
        if self.remote or self.machine != machine():
            return True
        return any(_alive(pid, started) for pid, started in self.pids)

    def describe(self, now: float) -> str:
        return (f"{self.command} (owner {self.owner[:8]}, on {self.machine.split('/')[0]}, "
                f"pids {', '.join(str(p) for p, _ in self.pids) or 'none'}; expires in {self.expires - now:.0f} s "
                f"unless renewed)")


def machine() -> str:
    """This machine: its hostname and boot id (a pid is of one boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}/{boot}"


def _started(pid: int) -> int:
    """A process's start time in clock ticks since boot (0: unknown), so a reused pid is
    not taken for the process that held the lease."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _alive(pid: int, started: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return started == 0 or _started(pid) in (0, started)


def _me() -> tuple[int, int]:
    return os.getpid(), _started(os.getpid())


def read(out: str) -> tuple[Lease | None, object]:
    data, version = storage.read_versioned(naming.lease(out))
    if data is None:
        return None, version
    try:
        return Lease.from_json(data), version
    except (ValueError, KeyError, TypeError):  # a torn or foreign object holds nothing
        return None, version


def acquire(out: str, command: str, ttl: float = LEASE_S, owner: str | None = None) -> Lease:
    """Take the lease on ``out`` for ``command``; LeaseHeld naming the holder while a live
    lease of another owner stands. A lapsed one is taken over (logged). ``owner``: a
    name that hosts elsewhere renew it by (a submitted job's; the lease is then live by
    its expiry alone), whose own live lease is taken up again (the same submit command
    following its job again); None: a fresh one, for this machine's processes."""
    if not storage.is_gcs(out) and os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(f"--out {out} is a file, not a folder: give a folder for the run's outputs")
    for _ in range(5):
        held, version = read(out)
        now = time.time()
        if held is not None and held.live(now) and (owner is None or held.owner != owner):
            raise LeaseHeld(f"{out} is in use by {held.describe(now)}: one run at a time writes an OUT. Wait for "
                            f"it to finish or stop it; a run that crashed releases it once it lapses (if it is "
                            f"gone for good, deleting {naming.lease(out)} releases it now)")
        lease = Lease(owner or uuid.uuid4().hex, command, machine(), (_me(),), now + ttl, owner is not None)
        try:
            storage.write_if(naming.lease(out), lease.to_json(), version)
        except storage.Conflict:
            continue  # another command wrote it between our read and write: look again
        if held is not None:
            logs.event("lease_taken_over", out=out, lapsed=held.describe(now))
        return lease
    raise LeaseHeld(f"{out}: its lease kept changing while this command tried to take it; another command is "
                    f"starting on it")


def renew(out: str, owner: str, ttl: float = LEASE_S, pids: tuple = ()) -> Lease:
    """Push ``owner``'s lease on ``out`` forward (adding ``pids``, this process among them);
    LeaseLost when another owner holds it or it is gone."""
    for _ in range(5):
        held, version = read(out)
        if held is None or held.owner != owner:
            taken = "it is gone" if held is None else f"it is held by {held.describe(time.time())}"
            raise LeaseLost(f"this process no longer holds the lease on {out}: {taken}")
        mine = tuple(sorted({*held.pids, *pids, _me()}))
        lease = dataclasses.replace(held, pids=mine, expires=max(held.expires, time.time() + ttl))
        try:
            storage.write_if(naming.lease(out), lease.to_json(), version)
            return lease
        except storage.Conflict:
            continue  # another holder of the same lease renewed it at the same moment
    return held


def release(out: str, owner: str) -> None:
    """Give the lease back, if ``owner`` still holds it."""
    held, _ = read(out)
    if held is not None and held.owner == owner:
        storage.delete([naming.lease(out)])


class Renewer:
    """A daemon thread that renews ``owner``'s lease on ``out`` every ``RENEW_S``; ``lost``
    is set (with the reason in ``why``) once another owner has it."""

    def __init__(self, out: str, owner: str):
        self.out, self.owner = out, owner
        self.lost, self.why = threading.Event(), ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease", daemon=True)

    def start(self) -> "Renewer":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                renew(self.out, self.owner)
            except LeaseLost as e:
                self.why = str(e)
                self.lost.set()
                return
            except Exception as e:  # a storage hiccup: the next renewal tries again before the lease lapses
                logs.event("lease_renewal_failed", error=f"{type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()


class Held:
    """``with Held(out, command):`` the lease for the command's work, renewed meanwhile and
    given back at the end. ``owner``: a submitted job's name, which its hosts renew the
    lease by (``acquire``); the lease is then kept when the command is stopped (Ctrl-C,
    SIGTERM), since the job it leaves running goes on holding it."""

    def __init__(self, out: str, command: str, owner: str | None = None):
        self.out, self.command, self.owner = out, command, owner
        self.lease: Lease | None = None
        self.renewer: Renewer | None = None

    def __enter__(self) -> "Held":
        self._made = _first_missing(self.out)  # a folder the lease makes, removed again if left empty
        self.lease = acquire(self.out, self.command, SUBMITTED_S if self.owner else LEASE_S, self.owner)
        self.renewer = Renewer(self.out, self.lease.owner).start()
        self._before = os.environ.get(OWNER_ENV)
        os.environ[OWNER_ENV] = self.lease.owner  # the hosts this command starts renew it (``host_renewer``)
        return self

    def __exit__(self, failed, *exc) -> None:
        self.renewer.stop()
        if self._before is None:
            os.environ.pop(OWNER_ENV, None)
        else:
            os.environ[OWNER_ENV] = self._before
        if self.owner is None or failed is None or not issubclass(failed, KeyboardInterrupt):
            release(self.out, self.lease.owner)
            if self._made:  # a command refused before it wrote anything leaves no empty OUT behind
                folder = os.path.abspath(self.out)
                while folder != os.path.dirname(self._made):
                    try:
                        os.rmdir(folder)
                    except OSError:
                        break
                    folder = os.path.dirname(folder)


def _first_missing(out: str) -> str | None:
    """The outermost folder of a local ``out`` that does not exist yet (None: it exists, or gs://)."""
    if storage.is_gcs(out):
        return None
    missing, folder = None, os.path.abspath(out)
    while not os.path.exists(folder):
        missing, folder = folder, os.path.dirname(folder)
    return missing


def host_renewer(out: str) -> Renewer | None:
    """A host's renewer of its run's lease (``OWNER_ENV``, set by whoever started it), once
    the host has joined it; LeaseLost if another owner has it already. None: started
    without one (a host run by hand)."""
    owner = os.environ.get(OWNER_ENV)
    if not owner:
        return None
    renew(out, owner)
    return Renewer(out, owner).start()
