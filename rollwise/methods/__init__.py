"""Methods: what one RL step adds between Filter and Train, one class per method (see `base.Method`).

`METHODS` maps a `[[stage]] kind` (or `algo.method`) to its class: `rl` (GRPO/PPO, the plain step), `opd` and `opsd`
(a teacher scores every sampled token), `sft` (NLL on demonstrations), `dcmdp` and `acrl` (control of the
engine-vs-trainer discrepancy); a plugin is named by `package.module:Class`. A new method is
a file plus a line here (or a plugin path), nothing in the loop, session or trainer. Entries are imported when
first looked up.
"""

from __future__ import annotations

from rollwise.methods.base import Method, MethodSetup, Prepared, Stage, StepInput
from rollwise.registry import Registry

METHODS: Registry[type[Method]] = Registry("method")
METHODS.register_lazy("rl", "rollwise.methods.rl:RL")
METHODS.register_lazy("opd", "rollwise.methods.teacher:OPD")
METHODS.register_lazy("opsd", "rollwise.methods.teacher:OPSD")
METHODS.register_lazy("sft", "rollwise.methods.sft:SFT")
METHODS.register_lazy("dcmdp", "rollwise.methods.discrepancy:DCMDP")
METHODS.register_lazy("acrl", "rollwise.methods.discrepancy:ACRL")
METHODS.register_lazy("mipu", "rollwise.methods.mipu:MIPU")
METHODS.register_lazy("adhint", "rollwise.rollout_strategies.adhint:ADHint")  # with rollout.strategy = "adhint"
METHODS.register_lazy("hargo", "rollwise.methods.hargo:HARGO")
METHODS.register_lazy("echorl", "rollwise.methods.echorl:EchoRL")
METHODS.register_lazy("progress", "rollwise.methods.progress:Progress")
METHODS.register_lazy("rorecomp", "rollwise.methods.rorecomp:RoRecomp")
METHODS.register_lazy("hrr", "rollwise.methods.hrr:HRR")
METHODS.register_lazy("duet", "rollwise.methods.duet:DUET")
METHODS.register_lazy("sgrpo", "rollwise.methods.sgrpo:SGRPO")
METHODS.register_lazy("tree", "rollwise.methods.tree:Tree")  # with rollout.strategy = "tree"

__all__ = ["METHODS", "Method", "MethodSetup", "Prepared", "Stage", "StepInput"]
