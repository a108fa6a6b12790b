"""Where the app's data comes from: the ``DataSource`` interface and its three implementations."""
from homepd.tui.sources.base import DataSource
from homepd.tui.sources.fake import FakeSource

__all__ = ["DataSource", "FakeSource"]
