"""Files and folders the cache creates are its owner's alone: KV pages are a tenant's data.

Folders are created 0700 and files 0600 whatever the process umask; a folder that already
existed keeps its mode (it is the operator's), only the levels created here are set.
"""

from __future__ import annotations

import os
from pathlib import Path

FOLDER_MODE = 0o700
FILE_MODE = 0o600


def make_private_folder(path: str | Path) -> Path:
    """Create `path` and any missing parents, each 0700 (chmod after mkdir: the umask cannot widen
    or narrow it). Returns the path. Raises OSError when it cannot be created."""
    path = Path(path)
    missing = []
    level = path
    while not level.exists():
        missing.append(level)
        if level.parent == level:
            break
        level = level.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=FOLDER_MODE)
        except FileExistsError:  # created beside us meanwhile: it is not ours to change
            continue
        os.chmod(folder, FOLDER_MODE)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a folder")
    return path


def open_private(path: str | Path, flags: int) -> int:
    """`os.open(path, flags | O_CLOEXEC, 0600)`; a file it creates is readable by its owner only."""
    return os.open(path, flags | os.O_CLOEXEC, FILE_MODE)
