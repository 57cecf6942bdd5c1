"""Test helper: screenshots of local HTML with Debian's chromium, and counting thumbnails in them.

A gallery test should prove that a browser shows the thumbnails, not just that the
HTML names them. ``screenshot`` renders a page with headless chromium; a broken
image shows as an icon and alt text, a loaded thumbnail as a solid size x size blob
of non-white pixels, which ``count_thumbnails`` counts.

``ensure`` finds chromium, installing Debian's package when we are root. Without
root and without chromium, the test fails and says how to install it: a gallery
test that does not run proves nothing.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
INSTALL_TIMEOUT_S = 900
SCREENSHOT_TIMEOUT_S = 120
_LOCK = os.path.join(tempfile.gettempdir(), "promptmill-chromium-install.lock")


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _apt(*args: str) -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        done = subprocess.run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"apt-get {' '.join(args)} failed: {e}") from e
    if done.returncode:
        raise RuntimeError(f"apt-get {' '.join(args)} exited with {done.returncode}:\n"
                           f"{_tail(done.stdout + done.stderr)}")


def ensure() -> str:
    """The chromium executable; installs Debian's package if missing and we are root."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    if os.geteuid() != 0:
        pytest.fail(f"{CHROMIUM} is missing and installing it needs root: run 'sudo apt-get install chromium', "
                    "then the tests again")
    with open(_LOCK, "w") as lock:  # one install at a time, across test processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.access(CHROMIUM, os.X_OK):
            started = time.monotonic()
            _apt("update")
            _apt("install", "-y", "--no-install-recommends", "chromium")
            print(f"installed chromium in {time.monotonic() - started:.1f}s")
    if not os.access(CHROMIUM, os.X_OK):
        raise RuntimeError(f"apt-get installed chromium, but {CHROMIUM} is not there")
    return CHROMIUM


def version() -> str:
    return subprocess.run([ensure(), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()


def screenshot(html_path, png_path, width: int, height: int) -> None:
    """Render the local file ``html_path`` in a width x height window into ``png_path``."""
    browser = ensure()
    png = Path(png_path).resolve()
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="promptmill-chromium-") as profile:
        args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--hide-scrollbars", "--force-device-scale-factor=1",
                f"--user-data-dir={profile}", f"--window-size={width},{height}", f"--screenshot={png}",
                Path(html_path).resolve().as_uri()]
        done = subprocess.run(args, capture_output=True, text=True, timeout=SCREENSHOT_TIMEOUT_S,
                              env=dict(os.environ, HOME=profile))
    if done.returncode or not png.exists():
        raise RuntimeError(f"chromium exited with {done.returncode} and wrote {'a' if png.exists() else 'no'} "
                           f"screenshot:\n{_tail(done.stdout + done.stderr)}")


def count_thumbnails(png_path, size: int = 128, tolerance: int = 3, white: int = 245) -> int:
    """How many solid, about size x size blobs of non-white pixels the screenshot has.

    Pixels with every channel at least ``white`` are background; the other pixels are
    grouped into 4-connected components. A component counts if its bounding box is
    within ``tolerance`` px of size x size and it fills at least half of it (the frame
    of a broken image would not).
    """
    import numpy as np
    from PIL import Image
    from scipy import ndimage

    with Image.open(png_path) as image:
        pixels = np.asarray(image.convert("RGB"))
    ink = (pixels < white).any(axis=2)
    labels, _ = ndimage.label(ink)
    count = 0
    for number, box in enumerate(ndimage.find_objects(labels), start=1):
        if box is None:
            continue
        height, width = box[0].stop - box[0].start, box[1].stop - box[1].start
        if abs(height - size) <= tolerance and abs(width - size) <= tolerance:
            if (labels[box] == number).sum() >= 0.5 * height * width:
                count += 1
    return count

