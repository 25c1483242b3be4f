"""Rollout engines behind one protocol (`Engine`)."""

from rollwise.generate.base import Engine, EngineCaps
from rollwise.generate.process import GenerationProcess
from rollwise.generate.torch_engine import TorchEngine

__all__ = ["Engine", "EngineCaps", "GenerationProcess", "TorchEngine"]
