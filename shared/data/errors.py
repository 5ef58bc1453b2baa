"""Errors raised while loading data, so callers can tell 'not installed' from 'broken file'."""

from __future__ import annotations

import pickle


class DatasetUnavailable(FileNotFoundError):
    """The dataset's files are not on this machine; the message says what to install or pass.

    A subclass of ``FileNotFoundError`` so generic ``OSError`` handlers still catch it.
    """


class DatasetFormatError(ValueError):
    """A dataset file exists but is not what its format promises (truncated, wrong magic, wrong shape)."""


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle asked for a global outside the allow-list; loading stopped before anything ran."""
