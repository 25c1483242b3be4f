"""Errors raised while resolving or loading a model."""

from rollwise.errors import UserError


class ModelNotFoundError(UserError, RuntimeError):
    """A model could not be found or read; the message names what was looked for and how to fix it."""
