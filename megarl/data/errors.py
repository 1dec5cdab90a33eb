"""Errors raised by the data side of the trainer."""

from __future__ import annotations


class DatasetError(ValueError):
    """A prompt dataset could not be loaded.

    A subclass of ``ValueError`` so callers that already treat bad configuration as a
    ``ValueError`` keep working, while the trainer can still single out data problems. The
    message always names the file (and the 1-based line for a bad row) so the user can open
    the offending row directly instead of bisecting a large file.
    """
