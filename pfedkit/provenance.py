"""Which pfedkit wrote a run: the release and a hash of the package's own source files, so a run resumed by a
changed pfedkit (an edited checkout has no new release number) is noticed rather than mixing two versions' results.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from . import __version__

PACKAGE = Path(__file__).resolve().parent
SOURCE_SUFFIXES = (".py", ".c", ".yaml", ".toml")  # what decides the arithmetic and the defaults of a run


@functools.lru_cache(maxsize=1)
def provenance() -> dict[str, str]:
    """{"version": the release, "source": the first 16 hex digits of the hash of every source file, path and bytes}.
    Computed once per process (about 100 small files)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in PACKAGE.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()
                       and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return {"version": __version__, "source": digest.hexdigest()[:16]}


def describe(info: object) -> str:
    """'pfedkit 0.1.0 (source 1a2b3c...)' for a recorded provenance, or what is known of it."""
    if not isinstance(info, dict):
        return "an unrecorded pfedkit version"
    version, source = str(info.get("version", "?"))[:20], str(info.get("source", "?"))[:16]
    return f"pfedkit {version} (source {source})"
