"""Hashes capline decides by: a file's sha256 (cached per stat for fingerprints, uncached for
checks), and the seeded order every sampling and shuffling step uses."""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    """sha256 of a file, hashed once per process while its size and mtime stay the same: a run's
    fingerprints (preflight, `--only` checks, the manifest, every stage's digest) all ask for it."""
    st = Path(path).stat()
    return _sha256_of(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns   # the cache key: a rewritten file is hashed again
    return hash_file(path)


def hash_file(path) -> str:
    """sha256 of the bytes on disk now, never cached (verify checks files that may have changed)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def order_key(seed: int, key: str) -> str:
    """The deterministic order capline samples and shuffles by: independent of arrival order."""
    return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()
