"""The one error type of the conversion tools and the model families they ask."""

from __future__ import annotations


class ConversionError(RuntimeError):
    """A checkpoint cannot be converted as asked; the message names the file and what to do."""
