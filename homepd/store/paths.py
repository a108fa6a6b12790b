"""Where the run database lives."""
from __future__ import annotations

import os
from pathlib import Path

DB_FILENAME = "homepd.db"


def default_db_path() -> Path:
    """``$HOMEPD_DB``, else ``$XDG_DATA_HOME/homepd/homepd.db``, else ``~/.local/share/homepd/homepd.db``."""
    override = os.environ.get("HOMEPD_DB")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    # why: the XDG spec says a relative XDG_DATA_HOME is invalid and must be ignored
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "homepd" / DB_FILENAME
