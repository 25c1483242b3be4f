"""The method seam: what one RL step adds between Filter and Train (after prime-rl's `Algorithm`).

The loop runs every step the same way, `collect -> method.prepare -> replay -> train -> sync`, and never asks
which method it runs. A method says, as data, how the step goes (`generates`, `keeps_uniform_groups`, `replays`,
`uses_teacher`) and, in `prepare`, turns the Filter stage's samples into what the trainer trains: the samples,
the `LossTerms` the trainer executes (`rollwise.train.terms`), and its metrics. The plain RL step (GRPO, PPO,
DAPO...) is this base class: nothing added.

A new method is a file with a `Method` subclass plus a registry entry (`rollwise.methods.METHODS`, or a plugin
`package.module:Class`), named by a `[[stage]] kind`. Its class method `checks(cfg)` returns the config errors it
can tell before any work (run by `rollwise train --dry-run`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from rollwise.config_distill import StageConfig
from rollwise.train.terms import LossTerms, PolicyTerms
from rollwise.types import Group, Sample


@dataclass(frozen=True)
class Stage:
    """One `[[stage]]`: RL steps `start + 1 .. end` of the run (1-based, as logged), `index` of `count` stages,
    run by the method `kind` names."""

    kind: str
    start: int
    end: int
    index: int
    count: int
    cfg: StageConfig | None = None

    def describe(self) -> str:
        return f"stage {self.index + 1}/{self.count} ({self.kind}, steps {self.start + 1}-{self.end})"


@dataclass
class StepInput:
    """What a method sees of one step.

    step: RL steps done before this one (the policy version the trainer holds); stage: its `[[stage]]`;
    groups: the groups Control assembled (scored and filtered; empty when the method does not generate);
    samples: the fresh samples the Filter stage kept, with their training rewards and advantages."""

    step: int
    stage: Stage
    groups: list[Group]
    samples: list[Sample]


@dataclass
class Prepared:
    """What a method hands the trainer: the samples to train (replay adds its own), the terms, its metrics, and
    per-sample extras for `samples/step-N.jsonl` (`record(sample) -> dict`)."""

    samples: list[Sample]
    terms: LossTerms = field(default_factory=PolicyTerms)
    metrics: dict[str, float] = field(default_factory=dict)
    record: Callable[[Sample], dict] = field(default=lambda sample: {})


@dataclass
class MethodSetup:
    """What the run gives a method when it is built (rollwise.build): the config, the policy module, the teacher
    (None when no stage uses one), the tokenizer and prompt encoder, the SFT stages' demonstration sources by
    stage index, and the trainer backend and Sync stage (None when a method is built alone)."""

    cfg: Any
    policy: Any = None  # the trained model (its architecture: e.g. a final-logit soft-cap)
    teacher: Any = None
    tokenizer: Any = None
    encoder: Any = None
    demo_sources: dict = field(default_factory=dict)
    trainer: Any = None  # the run's trainer backend (a method that restores an update: MIPU)
    sync: Any = None  # the run's Sync stage (`rollwise.sync.WeightSync`), set once built: a method that checks an
    # update on the engine before the step's own sync (MIPU) pushes through it


class Method:
    """The plain RL step; subclasses override what they change (see the module docstring)."""

    uses_teacher = False  # its samples are scored by the teacher (the collapse alarm watches such steps)
    keeps_uniform_groups = False  # keep groups whose rewards are all equal (a signal besides reward variance)
    replays = True  # the step draws from and adds to the replay buffer
    reads_demonstrations = False  # reads a `[[stage]] data` file

    options = None  # its `MethodOptions` subclass: the `[algo.<name>]` table it reads (None: it takes none)

    def __init__(self, setup: MethodSetup) -> None:
        self.setup = setup

    @property
    def opts(self):
        """This method's validated `[algo.<name>]` options (`options.of(cfg)`)."""
        return self.options.of(self.setup.cfg)

    @classmethod
    def checks(cls, cfg) -> list[str]:
        """Config errors this method can tell before any work (`--dry-run`)."""
        return []

    def generates(self, stage: Stage) -> bool:
        """The step samples from the engine (an SFT stage reading a demonstrations file does not)."""
        return True

    def prepare(self, step: StepInput) -> Prepared:
        return Prepared(step.samples)

    def after_update(self, policy) -> None:
        """Called after the step's update of `policy`, before the step's sync (an EMA teacher follows it; MIPU
        checks the update on the engine through `setup.sync` and may undo it)."""

    def state_dict(self) -> dict | None:
        """What a resumed run needs of this method (None: nothing)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        pass


def outcome_advantage_errors(method: str, cfg, what: str) -> list[str]:
    """One `--dry-run` line when `algo.advantage` is token-level for a method that works on outcome advantages
    (`what`: what the method does with them, e.g. "reweights outcome advantages")."""
    from rollwise import algo

    if not algo.is_token_advantage(cfg.algo.advantage):
        return []
    return [f"algo.method = {method!r} {what}; algo.advantage = {cfg.algo.advantage!r} is token-level: use grpo, "
            "dr_grpo, rloo or reinforce_pp"]
