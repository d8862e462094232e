"""Errors raised while opening a model source: a bad source string or a broken checkpoint."""

from __future__ import annotations

import os


class SourceError(ValueError):
    """A model source string that names nothing we can open (unknown scheme, name or option)."""


class CheckpointError(SourceError):
    """A checkpoint that cannot be used; `path` names the file at fault, `problem` says why."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
