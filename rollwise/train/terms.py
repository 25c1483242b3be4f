"""What a method adds to the trainer's loss for one step: the `LossTerms` the trainer is given with its batch.

`Trainer.step(samples, version, terms)` calls, per update:
- `terms.start()` once before its first micro-batch;
- per micro-batch `mb` (`rollwise.train.batching.MicroBatch`):
  `advantages(own_logp [S, T], mb, entropy [S, T]) -> [S] or [S, T]`, the advantages the policy loss uses
  (`own_logp`: the student's own untruncated log-probs of the sampled tokens, without gradient);
  `extra_loss(logp [S, T] (with gradient), hidden [n, H] or None, head [V, H], mb, aggregate, entropy) -> 0-d
  tensor`, added to the policy loss (`aggregate(per_token [S, T], mask [S, T])` is the run's loss aggregation,
  `entropy [S, T]` the policy's per-token entropy, with gradient);
- `metrics()` at the end: the terms' own metrics over the whole step.

`policy_loss = False` trains `extra_loss` alone (SFT on demonstrations, which have no advantage);
`needs_hidden` asks for the final hidden states of the response positions (a loss over the full vocabulary);
`compares_engine = False` leaves out the engine-vs-trainer `mismatch/*` (samples no engine sampled).

`PolicyTerms` is the plain RL step (GRPO, PPO, ...): the outcome or critic advantages, nothing added. A method
(`rollwise.methods`) builds its own terms; the trainer never reads a method or stage kind.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from rollwise.train.batching import MicroBatch

Aggregate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LossTerms(Protocol):
    policy_loss: bool
    needs_hidden: bool
    compares_engine: bool

    def start(self) -> None: ...

    def advantages(self, own_logp: torch.Tensor, mb: MicroBatch, entropy: torch.Tensor | None) -> torch.Tensor: ...

    def extra_loss(self, logp: torch.Tensor, hidden: torch.Tensor | None, head: torch.Tensor, mb: MicroBatch,
                   aggregate: Aggregate, entropy: torch.Tensor | None = None) -> torch.Tensor: ...

    def metrics(self) -> dict[str, float]: ...


class PolicyTerms:
    """The plain RL step: the advantages the Filter stage (or the critic) assigned, no extra loss."""

    policy_loss = True
    needs_hidden = False
    compares_engine = True

    def start(self) -> None:
        pass

    def advantages(self, own_logp: torch.Tensor, mb: MicroBatch, entropy: torch.Tensor | None) -> torch.Tensor:
        return mb.advantages

    def extra_loss(self, logp: torch.Tensor, hidden: torch.Tensor | None, head: torch.Tensor, mb: MicroBatch,
                   aggregate: Aggregate, entropy: torch.Tensor | None = None) -> torch.Tensor:
        return logp.new_zeros(())

    def metrics(self) -> dict[str, float]:
        return {}
