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


def results_dir(db: str | os.PathLike | None = None) -> Path:
    """Where advise writes its result files and pictures: an ``advise`` folder beside the database in use
    (``db``, else ``default_db_path()``), so two databases never share a result file name."""
    return (Path(db).expanduser() if db else default_db_path()).parent / "advise"
