"""Replace a file's contents in one step: readers see the old text or the new, never half."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``<path>.tmp``, then rename it over ``path`` (atomic on POSIX)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
