"""sha256 digests of files, kept per file identity: a model is hashed once, not at every hello or agent start.

A digest is kept in this process and on disk (fingerprint_cache_dir()) under the files' identity (path, size,
modification and change times, inode, device): a file rewritten, or replaced by another of the same size and
modification time (cp -p), has another identity and is hashed again (its change time moves on)."""

from __future__ import annotations

import os
from pathlib import Path


def cached_digest(files: list[Path], kind: str, compute) -> str:
    """compute() (a sha256 of the files), kept per kind of digest and the files' identity."""
    identity = kind + _file_identity(files)
    cached = _FINGERPRINTS.get(identity) or _read_cached_fingerprint(identity)
    if not cached:
        cached = compute()
        _write_cached_fingerprint(identity, cached)
    _FINGERPRINTS[identity] = cached
    return cached


_FINGERPRINTS: dict[str, str] = {}


def fingerprint_cache_dir() -> Path:
    from halo.host.cache import cache_subdir

    return cache_subdir("fingerprints", "HALO_FINGERPRINT_CACHE_DIR")


def _file_identity(files: list[Path]) -> str:
    parts = []
    for file in files:
        st = file.stat()
        parts.append(f"{os.fsencode(file.resolve())!r}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}|"
                     f"{st.st_dev}")
    return "\n".join(parts)


def _cache_file(identity: str) -> Path:
    import hashlib

    return fingerprint_cache_dir() / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.json"


def _read_cached_fingerprint(identity: str) -> str | None:
    import json

    try:
        entry = json.loads(_cache_file(identity).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(entry, dict) and entry.get("identity") == identity and isinstance(entry.get("sha256"), str) \
        and len(entry["sha256"]) == 64
    return entry["sha256"] if ok else None


def _write_cached_fingerprint(identity: str, sha256: str) -> None:
    """Best effort (a read-only home only costs the next start a re-hash); written whole, then renamed."""
    import json
    import tempfile

    target = _cache_file(identity)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, prefix=".fp-", suffix=".tmp", delete=False) as f:
            json.dump({"identity": identity, "sha256": sha256}, f)
        os.replace(f.name, target)
    except OSError:
        pass
