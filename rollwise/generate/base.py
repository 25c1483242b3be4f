"""The engine protocol: what the loop needs from anything that generates responses."""

from __future__ import annotations

from typing import Protocol

import torch

from rollwise.types import GenerationRequest, GenerationResult


class Engine(Protocol):
    """A rollout engine (in-process PyTorch sampler, vLLM, SGLang, an HTTP server...).

    `version` is the policy version of the weights it currently samples with.
    """

    version: int

    def generate(self, requests: list[GenerationRequest], on_finish=None) -> list[GenerationResult]:
        """Run the requests to completion (or abort); results in request order. `on_finish(result)`, when
        given, is called as each request finishes and may call `abort` on the others."""
        ...

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new policy weights and adopt `version`."""
        ...

    def abort(self, request_ids: list[int]) -> None:
        """Stop these requests at the next token; they return with status `aborted`."""
        ...
