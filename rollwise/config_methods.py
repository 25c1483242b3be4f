"""Config keys of the methods (seed papers) that enter through a seam: rollout strategies, reward methods and
the `algo.method` family (docs/algorithms.md). Kept apart from `rollwise.config` for size; `RolloutConfig`,
`RewardConfig` and `AlgoConfig` inherit these keys, so they read as `cfg.rollout.rethink_fraction` etc.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

ROLLOUT_STRATEGY_NAMES = ("plain", "rethink", "adhint", "tandem", "eepo", "tree", "duet")


class RolloutStrategyKeys(BaseModel):
    """`[rollout]` keys of the rollout strategies (rollwise/rollout_strategies/)."""

    # rollout strategies (rollwise/rollout_strategies/): how one round of generation makes its samples
    strategy: str = Field("plain", description="rollout strategy: 'plain' (one engine call per round), 'rethink' "
                          "(Forced Rethinking), 'adhint' (ADHint hint prefixes), 'tandem' (Tandem RL: a frozen junior "
                          "writes some segments), 'eepo' (EEPO: the second half of each group from an unlearned "
                          "copy), 'tree' (rStar-Math / MedS3 tree-search rollouts), 'duet' (DUET, with algo.method "
                          "= 'duet'), or a plugin "
                          "'package.module:factory'")
    rethink_trigger: str = Field("\nWait, let me check.", min_length=1, description="rethink: text appended (loss "
                                 "mask 0) to a completed response before it is continued")
    rethink_fraction: float = Field(0.5, ge=0.0, le=1.0, description="rethink: probability that a completed "
                                    "response gets the trigger and is continued")
    rethink_max_new_tokens: int = Field(0, ge=0, description="rethink: tokens the continuation may add after the "
                                        "trigger; 0 = rollout.max_new_tokens")
    adhint_max_ratio: float = Field(0.5, ge=0.0, le=1.0, description="adhint: share of the hint's tokens given to "
                                    "a prompt the policy never solves (the ratio falls linearly to 0 at accuracy 1)")
    adhint_samples: int | None = Field(None, ge=1, description="adhint: samples of each group that get the hint "
                                       "prefix (the others roll out without it), below rollout.samples_per_prompt; "
                                       "None = half the group")
    adhint_weight: float = Field(0.5, ge=0.0, le=1.0, description="adhint: gradient weight of a hinted response's "
                                 "own tokens (its advantage is scaled by it); 1 = no modulation")
    adhint_momentum: float = Field(0.5, ge=0.0, lt=1.0, description="adhint: running accuracy per prompt (and "
                                   "overall) = momentum x old + (1 - momentum) x the new group's accuracy")
    duet_budget_tokens: int = Field(0, ge=0, description="duet (rollout.strategy 'duet'): rollout tokens one "
                                    "generation round may spend; the rollouts it buys go to prompts by "
                                    "informativeness; 0 = samples_per_prompt for every prompt")
    duet_min_samples: int = Field(2, ge=2, description="duet: rollouts every prompt gets, whatever its "
                                  "informativeness")
    duet_abort_tokens: int = Field(0, ge=0, description="duet: a rollout that has not written duet_marker after this "
                                   "many tokens is aborted there (and left out of the update); 0 = no abort rule")
    duet_marker: str = Field("The answer is", min_length=1, description="duet: the text whose appearance lets a "
                             "rollout continue past duet_abort_tokens")
    duet_momentum: float = Field(0.5, ge=0.0, lt=1.0, description="duet: running pass rate = momentum x old + "
                                 "(1 - momentum) x the new group's; also the running tokens per rollout")
    tandem_junior: str | None = Field(None, description="tandem: the frozen junior (a local model directory, a hub "
                                      "id or 'smollm2-135m-instruct', sharing the policy's tokenizer); None = a "
                                      "frozen copy of the initial policy")
    tandem_segment_tokens: int = Field(8, ge=1, description="tandem: tokens of one segment (one author)")
    tandem_junior_prob: float = Field(0.5, ge=0.0, le=1.0, description="tandem: probability that a segment after "
                                      "the first (always the senior's) is written by the junior")
    eepo_unlearn_steps: int = Field(1, ge=0, description="eepo: AdamW steps that lower the likelihood of the first "
                                    "half's responses on the temporary copy (0 = no unlearning)")
    eepo_unlearn_lr: float = Field(1e-5, gt=0.0, description="eepo: learning rate of those steps")
    tree_simulations: int = Field(16, ge=1, description="tree: MCTS simulations per prompt (each yields one complete "
                                  "response; the group keeps the last rollout.samples_per_prompt of them)")
    tree_branches: int = Field(2, ge=1, description="tree: child steps the policy samples when a node is expanded")
    tree_step_tokens: int = Field(16, ge=1, description="tree: most tokens of one step (a step also ends after a "
                                  "token containing a newline)")
    tree_c_puct: float = Field(1.0, ge=0.0, description="tree: UCT exploration constant c in Q(child) + c sqrt(ln "
                               "N(parent) / N(child))")

    @model_validator(mode="after")
    def _tree_keeps_enough(self):
        spp = getattr(self, "samples_per_prompt", None)
        if self.strategy == "tree" and spp is not None and self.tree_simulations < spp:
            raise ValueError(f"rollout.tree_simulations = {self.tree_simulations} gives fewer responses than "
                             f"rollout.samples_per_prompt = {spp}; set rollout.tree_simulations >= {spp}")
        return self

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, name: str) -> str:
        if name not in ROLLOUT_STRATEGY_NAMES and ":" not in name:
            raise ValueError(f"unknown rollout strategy {name!r}; valid: {', '.join(ROLLOUT_STRATEGY_NAMES)} "
                             "(or a plugin 'package.module:factory')")
        return name


class RewardMethodKeys(BaseModel):
    """`[reward]` keys of the reward methods: CME, verifier noise, MemReward."""

    # reward.fn = "cme": Cross-Model Entropy, a label-free reward from a second model (rollwise/rewards/cme.py)
    cme_model: str | None = Field(None, description="cme: the verifier model (a local HF directory, a hub id or "
                                  "'smollm2-135m-instruct') whose mean log-likelihood per response token is the reward")
    cme_verifier: str | None = Field(None, description="cme: a verifier (e.g. 'arith') whose verdict is recorded as "
                                     "`correct` for accuracy metrics and held-out evaluation, never the reward; "
                                     "None = no verdict (accuracy reads 0)")
    cme_batch_size: int = Field(16, ge=1, description="cme: responses scored by the verifier model in one forward")
    # verifier noise (rollwise/rewards/noise.py): flips of the training reward, never of held-out evaluation
    noise_fp: float = Field(0.0, ge=0.0, le=1.0, description="verifier noise: probability that an incorrect "
                            "response is scored as correct (reward 1, correct) in training")
    noise_fn: float = Field(0.0, ge=0.0, le=1.0, description="verifier noise: probability that a correct response "
                            "is scored as incorrect (reward 0, not correct) in training")
    noise_seed: int = Field(0, description="verifier noise: seed of the flips (a flip depends on the seed, the "
                            "prompt and the response text only)")
    # MemReward (rollwise/rewards/memreward.py): label propagation to rollouts of unlabelled prompts
    label_fraction: float = Field(1.0, gt=0.0, le=1.0, description="memreward: share of training prompts whose "
                                  "rollouts get the verifier's reward; the rest get rewards propagated from "
                                  "labelled rollouts over a similarity graph; 1 = off")
    label_seed: int = Field(0, description="memreward: seed of which prompts are labelled (fixed by seed and uid)")


class AlgoMethodKeys(BaseModel):
    """`[algo]` keys of `algo.method` and of the methods it names (rollwise/methods/)."""

    method: str = Field("rl", description="the method of a run without [[stage]] tables (rollwise.methods): rl; "
                        "acrl, dcmdp, mipu (training-inference mismatch); hargo, echorl, progress, sgrpo, rorecomp, "
                        "hrr, duet, "
                        "tree, adhint (docs/seed_methods.md); or a plugin 'pkg.mod:Class'; a teacher (teacher.weights) "
                        "makes it opd / opsd")
    discrepancy_measure: Literal["k3", "abs_gap"] = Field(
        "k3", description="acrl / dcmdp: the engine-vs-trainer discrepancy D of a step, on tokens of the current "
        "version: k3 = KL(engine || trainer) estimate (mismatch/k3), abs_gap = mean |log-prob gap|")
    discrepancy_target: float = Field(0.01, gt=0.0, description="dcmdp: the tolerance D may reach; acrl: the most D "
                                      "the tokens an update trains on may have")
    dual_lr: float = Field(10.0, gt=0.0, description="dcmdp: lambda <- clip(lambda + dual_lr x (D - target), 0, "
                           "dual_max) after each step")
    dual_max: float = Field(100.0, gt=0.0, description="dcmdp: lambda is kept at most this")
    acrl_gain: float = Field(1.0, gt=0.0, le=1.0, description="acrl: the gap threshold moves this far (geometrically) "
                             "toward the one fitted to the last step: 1 = take it, below 1 = smooth it")
    acrl_threshold_max: float = Field(2.0, gt=0.0, description="acrl: the loosest (and first) threshold on a "
                                      "token's |log-prob gap| (2.0: a probability ratio of e^2 = 7.4)")
    acrl_threshold_min: float = Field(0.05, gt=0.0, description="acrl: the tightest threshold")
    hargo_alpha: float = Field(1.0, ge=0.0, description="hargo: strength of the group's reward contrast D in the "
                               "modulated advantage M = A (1 + alpha D)(1 + gamma u)")
    hargo_gamma: float = Field(1.0, ge=0.0, description="hargo: strength of the reference-confidence surprise u")
    hargo_temperature: float = Field(2.0, gt=0.0, description="hargo: per-response weights w = n softmax(|M| / "
                                     "mean|M| / temperature) over the batch; larger = closer to plain GRPO (w = 1)")
    echorl_coef: float = Field(0.1, ge=0.0, description="echorl: weight of the auxiliary NLL of the EchoClips "
                               "(low-entropy spans of correct responses in all-success groups)")
    echorl_clip_frac: float = Field(0.25, gt=0.0, le=1.0, description="echorl: an EchoClip's length as a fraction "
                                    "of the response's trained tokens (the contiguous span of lowest mean entropy)")
    tree_value_coef: float = Field(1.0, ge=0.0, le=1.0, description="tree (with rollout.strategy 'tree'): a "
                                   "token's advantage = (1 - coef) x the outcome advantage + coef x (Q(its step) - "
                                   "Q(the step before)), Q from the tree search; 1 = step values only")
    progress_coef: float = Field(0.5, ge=0.0, description="progress: weight beta of the progress advantage "
                                 "beta x sum of log(pi / pi_ref) over a step's tokens, added to the outcome advantage")
    progress_step_tokens: int = Field(8, ge=1, description="progress: tokens per reasoning step (the response is cut "
                                      "into steps of this many trained tokens)")
    rorecomp_compensation_size: int = Field(16, ge=0, description="rorecomp: responses of a compensation batch "
                                            "(from the buffer of those left out of priority batches) joined to "
                                            "an update once the buffer holds that many; 0 = priority batches only")
    rorecomp_max_age: int = Field(4, ge=0, description="rorecomp: buffered responses older than this many policy "
                                  "versions are evicted")
    hrr_weight: float = Field(1.0, gt=0.0, description="hrr: a relabelled response's advantage is hrr_weight x "
                              "(its reward under the relabelled goal - its group's mean reward)")
    hrr_max_per_group: int = Field(4, ge=1, description="hrr: at most this many failed responses of a group are "
                                   "relabelled and replayed per step")
    moa_weights: dict[str, float] = Field(default_factory=dict, description="moa: weight of each reward part "
                                          "(by name, e.g. {correct = 1.0, format = 0.5}); each part is normalised "
                                          "within its group before the weighted sum")
    sgrpo_coef: float = Field(0.1, ge=0.0, description="sgrpo: weight of the set-level diversity credit added to "
                              "the utility reward (one reply's credit can reach sets' size x D: at 0.5 it outweighs "
                              "a 0/1 utility)")
    sgrpo_ngram: int = Field(2, ge=1, le=8, description="sgrpo: n of the distinct token n-grams that measure a "
                             "set's diversity")
    sgrpo_sets: int = Field(2, ge=1, description="sgrpo: candidate sets each prompt's responses are split into "
                            "(the supergroup); rollout.samples_per_prompt must be a multiple of it, with at least "
                            "2 responses per set")
    mipu_tolerance: float = Field(1e-3, ge=0.0, description="mipu: a candidate update is kept when the engine-side "
                                  "proxy (surrogate gain - mipu_kl_coef x KL, in advantage units) is >= -tolerance; "
                                  "else the trainer's weights and optimizer state are restored")
    mipu_kl_coef: float = Field(1.0, ge=0.0, description="mipu: weight of the engine-side KL(sampler || candidate) "
                                "estimate subtracted from the surrogate gain in the proxy; 0 = the bare surrogate")
    mipu_max_rejects_in_row: int = Field(10, ge=0, description="mipu: the run stops when this many updates in a "
                                         "row are rejected (the policy cannot move); 0 = never stop")
    slas_power: float = Field(2.0, ge=1.0, le=8.0, description="slas (algo.advantage = 'slas'): exponent p of the "
                              "super-linear shaping sign(a)|a|^p of the group-centred advantage before the batch "
                              "normalisation; p > 1 amplifies large advantages over small ones, 1 = linear control")

    @model_validator(mode="after")
    def _slas_power_needs_slas(self) -> "AlgoMethodKeys":
        # against the default, not model_fields_set: a saved run's config.toml writes every key (resume)
        if self.slas_power != 2.0 and getattr(self, "advantage", "slas") != "slas":
            raise ValueError(f"algo.slas_power is set but algo.advantage = {getattr(self, 'advantage')!r}: set "
                             "algo.advantage = 'slas' or remove algo.slas_power")
        return self
