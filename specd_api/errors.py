"""Errors a user can cause and fix. The CLI prints their message as one line; nothing else is caught."""

from __future__ import annotations


class SpecdError(Exception):
    """Base for errors that carry a message meant for the user, not a traceback."""


class ModelLoadError(SpecdError):
    """A model or tokenizer could not be loaded from the given path."""


class TokenizerMismatchError(SpecdError):
    """Draft and target do not share a vocabulary, so draft tokens would mean different things."""


class UsageError(SpecdError):
    """A setting given on the command line or in a request is out of range."""
