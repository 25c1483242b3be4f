"""Imports the modules of the built-in environments so that they register in `ENVS` (one line each)."""
from rollwise.envs import calc  # noqa: F401
from rollwise.envs import lookup  # noqa: F401
from rollwise.envs import pyexec  # noqa: F401
