"""What a tree of objects holds, for tests that compare one before and after a command."""
import hashlib
import os

from pipeline.io import gcs, storage


def checksums(prefix: str) -> dict[str, str]:
    """{name relative to ``prefix``: ``SIZE:HASH``} of every object under it: on GCS from one
    listing (``gcs.checksum``: nothing is read), locally the sha256 of each file's bytes."""
    prefix = prefix.rstrip("/")
    if storage.is_gcs(prefix):
        return {path[len(prefix) + 1:]: gcs.checksum(blob) for path, blob in gcs.blobs(prefix + "/")}
    sums = {}
    for path in sorted(storage.files(prefix)):
        with open(path, "rb") as f:
            sums[os.path.relpath(path, prefix).replace(os.sep, "/")] = \
                f"{os.path.getsize(path)}:{hashlib.sha256(f.read()).hexdigest()}"
    return sums
