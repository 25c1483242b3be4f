"""A scalar value head on the policy's final hidden states, for PPO with GAE (`algo.advantage = "gae"`).

The value of the state before response token t is read at the position that predicts t (the same hidden
state the LM head reads). The head is one linear layer initialised to zero, so the first values are 0 and
the first advantages are the plain returns.
"""

from __future__ import annotations

import torch

from rollwise.train.batching import MicroBatch


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, flat_h: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """flat_h: [n, H] hidden states of the valid response positions of `mb` -> values [S, T] fp32."""
        values = self.proj(flat_h.float()).squeeze(-1)  # [n]
        S, T = mb.targets.shape
        return torch.zeros(S, T, dtype=torch.float32, device=mb.device).masked_scatter(mb.valid, values)
