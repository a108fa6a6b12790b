"""Errors the store raises (part of homepd's ``HomepdError`` tree)."""
from __future__ import annotations

from homepd.errors import HomepdError


class StoreError(HomepdError):
    """The run database cannot be opened, read or written as asked."""


class RunNotFoundError(StoreError):
    """A run reference (an id or ``last``) that names no run in the database."""

    def __init__(self, ref: str, path: str):
        self.ref, self.path = ref, path
        super().__init__(f"no run {ref!r} in {path} (`homepd history` lists the runs; RUN is an id or 'last')")
