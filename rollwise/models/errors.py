"""Errors raised while resolving or loading a model."""


class ModelNotFoundError(RuntimeError):
    """A model could not be found or read; the message names what was looked for and how to fix it."""
