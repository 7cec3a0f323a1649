"""Where halo keeps what it downloads or measures, and the one way anything in it is removed.

The root is $XDG_CACHE_HOME/halo, else ~/.cache/halo. Each kind of file has its own subdirectory and
its own environment variable, owned by one module:

- models/ (HALO_CACHE_DIR): named models `halo-master fetch` downloads (halo/model/catalog.py);
- devices/ (HALO_DEVICE_CACHE_DIR): device benchmarks and head-importance profiles the scheduler
  measured (halo/runtime/measure.py, halo/scheduler/importance.py);
- fingerprints/ (HALO_FINGERPRINT_CACHE_DIR): model sha256 digests by file identity (halo/model/digests.py).

Nothing ever removes a directory here, nor a file it did not write: a cache cleans up with
`remove_files`, which deletes only regular files directly in one directory whose names match the
owner's pattern (a user who points two variables at one directory loses nothing but stale entries).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def cache_root() -> Path:
    """$XDG_CACHE_HOME/halo, else ~/.cache/halo."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "halo"


def cache_subdir(kind: str, env: str) -> Path:
    """The directory of one kind of cached file: $env if set, else <root>/<kind>."""
    return Path(os.environ[env]) if os.environ.get(env) else cache_root() / kind


def as_if_created(path: Path, directory: bool = False) -> None:
    """A temporary file or directory (mkstemp/mkdtemp: private, 0600/0700) given the mode open() or mkdir() would have
    given it under this process's umask, before it is renamed into place: what root prepares or fetches stays
    readable by an agent's service account (a prepared directory of 0700 failed every HALO-mode hello on a Pi)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if directory else 0o666) & ~umask)


def remove_files(directory: Path, pattern: str, older_than_s: float | None = None) -> int:
    """Delete the regular files directly in `directory` whose names match the glob `pattern` (and, given
    older_than_s, that were last written longer ago than that); never a directory, never a link, never
    below `directory`. Returns how many went."""
    if "/" in pattern or "**" in pattern:
        raise ValueError(f"remove_files takes a file-name pattern, not a path: {pattern!r}")
    removed, now = 0, time.time()
    try:
        entries = list(directory.glob(pattern))
    except OSError:
        return 0
    for path in entries:
        try:
            status = path.lstat()
            if path.parent != directory or path.is_symlink() or not path.is_file():
                continue
            if older_than_s is not None and now - status.st_mtime <= older_than_s:
                continue
            path.unlink()
            removed += 1
        except OSError:
            continue  # gone meanwhile, or not ours to remove: leave it
    return removed


DEVICE_CACHE_ENV = "HALO_DEVICE_CACHE_DIR"  # tests and benchmarks point it at a temporary directory


def device_cache_dir() -> Path:
    """$HALO_DEVICE_CACHE_DIR, else $XDG_CACHE_HOME/halo/devices, else ~/.cache/halo/devices."""
    return cache_subdir("devices", DEVICE_CACHE_ENV)
