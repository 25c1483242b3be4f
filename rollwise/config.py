"""Typed run configuration: one shallow section per stage. `rollwise.config_load.load_config` reads a TOML recipe
plus `section.key=value` overrides into it; unknown keys and bad values fail before any work, with a message that
lists what is valid.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, PlainSerializer, PrivateAttr, SecretStr, field_serializer, field_validator,
                      model_validator)

from rollwise.config_distill import DistillConfig, StageConfig, TeacherConfig
from rollwise.config_methods import ConfigError, TablesSection  # noqa: F401 (ConfigError is re-exported)

EMBEDDED_MODEL = "smollm2-135m-instruct"


Options = dict[str, float | int | bool | str]

# A secret (an API key): `SecretStr` in Python (repr and str show `**********`), `***` in every JSON dump (the
# trackers' hyperparameters), and never written by `to_toml` (config.toml, --dry-run); the field's
# `json_schema_extra["env"]` names the environment variable it is also taken from.
SECRET_MASK = "***"
Secret = Annotated[SecretStr, PlainSerializer(lambda _: SECRET_MASK, return_type=str, when_used="json")]


def secret_value(secret: SecretStr | str | None) -> str | None:
    """The text of a secret field (None when unset)."""
    return secret.get_secret_value() if isinstance(secret, SecretStr) else secret


def secret_keys() -> dict[str, str]:
    """`section.key` -> environment variable of every secret field of `Config` (and `section.method.key` of
    every registered method table, e.g. `reward.judge.api_key`)."""
    from rollwise.config_methods import OPTION_MODELS

    models = [(sec_name, sec.annotation) for sec_name, sec in Config.model_fields.items()]
    models += [(f"{sec}.{name}", model) for (sec, name), model in OPTION_MODELS.items()]  # [reward.judge]
    out = {}
    for prefix, model in models:
        for key, info in getattr(model, "model_fields", {}).items():
            env = (info.json_schema_extra or {}).get("env") if isinstance(info.json_schema_extra, dict) else None
            if env:
                out[f"{prefix}.{key}"] = env
    return out


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    name: str = Field(EMBEDDED_MODEL, description="embedded model name, a local HF model directory, or a hub id "
                      "'org/name[@revision]' (through the HF cache; offline with HF_HUB_OFFLINE=1)")
    dtype: Literal["float32", "bfloat16", "auto"] = Field(
        "float32", description="rollout engine dtype; auto = bfloat16 where the CPU has native bf16"
    )
    threads: int = Field(0, ge=0, description="torch intra-op threads; 0 = the cores other processes leave "
                         "free, re-checked every step (env ROLLWISE_THREADS = N | cores | auto)")


class DataConfig(Section):
    task: str = Field("arith", description="built-in task (arith, letters) or plugin 'pkg.mod:fn'")
    path: str | None = Field(None, description="JSONL / Parquet file, an HF datasets directory or dataset folder, or a "
                             "hub dataset id 'org/name[@revision]' (data.config, data.split_name)")
    eval_path: str | None = Field(None, description="held-out file; None = a fixed slice of data.path")
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    system_prompt: str | None = Field(None, description="system turn; None keeps the chat template's default")
    max_prompt_tokens: int = Field(256, gt=0)
    options: Options = Field(default_factory=dict, description="keyword options of the task (calc: example_prob, "
                             "withdraw_at, withdraw_step, guided_samples, max_replaced_frac)")
    digits: int = Field(1, ge=1, le=6, description="arith: digits per operand")
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-"])
    eval_size: int = Field(512, ge=1, description="size of the fixed held-out split (at most a quarter of a "
                           "file without data.eval_path; the chosen size is printed)")
    split: Literal["prompt", "fact"] = Field(
        "prompt", description="arith: 'prompt' holds out prompt texts (the same fact may be trained under another "
        "phrasing); 'fact' holds out (a, b, op) facts never seen in training")
    config: str | None = Field(None, min_length=1, description="configuration of a dataset that has several (the "
                               "name argument of datasets.load_dataset, e.g. 'main' for openai/gsm8k)")
    split_name: str = Field("train", min_length=1, description="split of data.path to train on, for a hub dataset "
                            "id, a dataset folder or a saved DatasetDict (a single file is one split)")
    eval_split_name: str | None = Field(None, min_length=1, description="held-out split, e.g. 'test': of "
                                        "data.eval_path when given (else that dataset's train split), otherwise of "
                                        "data.path; None = a fixed slice of data.path is held out")
    mix: list["MixSource"] = Field(default_factory=list, description="[[data.mix]] tables: a mixture of sources, "
                                   "each a task or path with any data key, plus name, weight and reward "
                                   "(docs/tasks.md)")

    @field_validator("ops")
    @classmethod
    def _ops_not_empty(cls, ops: list[str]) -> list[str]:
        if not ops:
            raise ValueError("ops must name at least one operator")
        return ops

    @field_serializer("mix")
    def _mix_tables(self, mix: list["MixSource"]) -> list[dict[str, Any]]:
        """Each table as the keys it sets (config.toml writes it as an inline table; unset keys would be None)."""
        out = []
        for entry in mix:
            keys = entry.model_dump(mode="json", exclude_none=True, exclude_defaults=True, exclude={"mix"})
            source = {"path": entry.path} if entry.path is not None else {"task": entry.task}
            out.append({"name": entry.name, "weight": entry.weight, **source, **keys})
        return out


MIX_NAME = r"^[A-Za-z0-9_.-]+$"  # a source name is a metric path segment: reward/<name>/accuracy


class MixSource(DataConfig):
    """One `[[data.mix]]` table: a source (any data key: task or path, options, eval_size...) with its name,
    weight and reward."""

    name: str = Field("", pattern=MIX_NAME, description="the source's name in metrics (reward/<name>/accuracy) and "
                      "in Prompt.origin; default: the reasoning-gym dataset or task name, or the file's stem")
    weight: float = Field(1.0, gt=0.0, description="share of training prompts, relative to the other tables")
    reward: str | None = Field(None, description="reward name or 'pkg.mod:fn'; None = the source's own")

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("name"):
            path, task = data.get("path"), data.get("task") or "arith"
            if path:
                tail = str(path).rstrip("/").replace("\\", "/").rsplit("/", 1)[-1].split("@", 1)[0]
                name = tail.split(".", 1)[0] or tail
            else:
                name = str(task).rsplit(":", 1)[-1]
            data = {**data, "name": name}
        return data


DataConfig.model_rebuild()


class RolloutConfig(TablesSection, Section):
    """Generation: the engine, sampling, and `strategy` with its table (`[rollout.<strategy>]`)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    strategy: str = Field("plain", description="rollout strategy (rollwise/rollout_strategies/), its options in "
                          "[rollout.<strategy>]: 'plain' (one engine call per round), 'rethink', 'adhint', 'tandem', "
                          "'eepo', 'tree', 'duet', or a plugin 'package.module:factory'")
    engine: Literal["auto", "torch", "vllm", "sglang", "openai"] = Field(
        "auto", description="rollout engine: auto (vllm on a CUDA train.device with vLLM installed, else torch), "
        "'torch' (in-process, CPU or GPU), 'vllm' (in-process vllm.LLM, or "
        "its OpenAI server with rollout.server = 'launch' or a URL), 'sglang' / 'openai' (a running server at "
        "rollout.server)")
    server: str | None = Field(None, description="vllm: None = in-process, 'launch' = start vLLM's OpenAI server "
                               "in its own process, or the URL of one already running; sglang/openai: the URL")
    engine_options: dict[str, float | int | bool | str | Options] = Field(
        default_factory=dict, description="extra keyword arguments of the engine, e.g. vllm: gpu_memory_utilization "
        "= 0.5, enforce_eager = true, quantization = 'fp8', speculative_config = {method = 'ngram', "
        "num_speculative_tokens = 3, prompt_lookup_max = 4}; torch: weight_quant = 'int8', draft_model = DIR "
        "(speculative decoding with exact rejection sampling), draft_tokens = 4 (proposals per round)")
    request_timeout_s: float = Field(600.0, gt=0.0, description="server engines: time limit of one HTTP call")
    prompts_per_step: int = Field(8, gt=0)
    samples_per_prompt: int = Field(8, gt=0)
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)
    max_batch_size: int = Field(64, gt=0, description="sequences decoded together")
    source: Literal["local", "service"] = Field("local", description="'service' = generate through a running "
                                                "`rollwise serve` at rollout.service_url (another machine)")
    service_url: str | None = Field(None, description="rollout.source = 'service': the server's URL")
    service_api_key: Secret | None = Field(None, description="its Bearer token, a secret never written to "
                                           "config.toml; None = $ROLLWISE_API_KEY", json_schema_extra={
                                               "env": "ROLLWISE_API_KEY"})

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, stop: list[str]) -> list[str]:
        if any(s == "" for s in stop):
            raise ValueError("an empty stop string would end every response after one token; remove it")
        return stop


class RewardConfig(TablesSection, Section):
    """Scoring: `fn` with its table (`[reward.<fn>]`), and reward wrappers' tables (`[reward.noise]`)."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    fn: str | None = Field(None, description="reward name or 'pkg.mod:fn'; None = the task's verifier")
    format_weight: float = Field(0.0, description="weight of the format part (answer present)")
    timeout_s: float = Field(20.0, gt=0.0, description="time limit of one reward call; a reward that runs over "
                             "it is marked failed (rewards run in a worker process when reward.isolate)")
    isolate: bool = Field(False, description="run the reward in a worker process that is killed at timeout_s "
                          "(stops rewards that hang in C code)")
    max_failed_steps: int = Field(2, ge=1, description="stop the run when every reward of this many steps in a "
                                  "row failed")


class ServeConfig(Section):
    """`rollwise serve`: the policy behind an HTTP API (docs/serve.md). Command-line flags override these."""

    host: str = Field("127.0.0.1", description="bind address; anything but loopback exposes the policy")
    port: int = Field(8765, ge=0, le=65535, description="0 = a free port (printed at start)")
    api_key: Secret | None = Field(None, description="Bearer token clients must send, a secret never written "
                                   "to config.toml; None = $ROLLWISE_SERVE_API_KEY, else a generated one, printed "
                                   "at start", json_schema_extra={"env": "ROLLWISE_SERVE_API_KEY"})
    max_queued_requests: int = Field(256, gt=0, description="requests waiting for the engine at most; more get 503")
    episode_ttl_s: float = Field(3600.0, gt=0.0, description="finished episode jobs are kept this long for GET")
    max_body_mb: float = Field(32.0, gt=0.0, description="JSON request bodies at most (MiB); larger get 413")
    max_prompts_per_request: int = Field(512, gt=0, description="prompts in one completion or episode request at "
                                         "most; more get 413")
    max_weights_mb: float = Field(16384.0, gt=0.0, description="a safetensors body of POST /v1/weights at most "
                                  "(MiB); larger gets 413")
    max_weight_uploads: int = Field(1, ge=1, description="weight uploads in progress at once; one more gets 429")
    weights_root: str | None = Field(None, description="POST /v1/weights loads {\"path\"} only from files under "
                                     "this folder; None = path loading off (weights come as a body)")
    tinker_state_dir: str | None = Field(None, description="`--api tinker`: where save_state writes checkpoints "
                                         "(a restarted server loads them); None = $ROLLWISE_CACHE/tinker")


class EnvConfig(Section):
    """Multi-turn episodes with tools (docs/agentic.md). `name = None` keeps one response per prompt."""

    name: str | None = Field(None, description="environment: calc, lookup, pyexec, tool, or 'pkg.mod:fn'; "
                             "None = the task's own (single turn for arith and letters)")
    max_turns: int = Field(4, ge=1, description="assistant turns per episode at most")
    max_episode_tokens: int = Field(512, gt=0, description="tokens after the prompt (policy and tool) at most; "
                                    "an episode that reaches it is truncated")
    parser: Literal["tag", "hermes"] = Field("tag", description="tool-call syntax: tag '<calc>EXPR</calc>' or "
                                             "hermes '<tool_call>{json}</tool_call>'")
    options: Options = Field(default_factory=dict, description="keyword options of the environment")
    schedule: Literal["continuous", "asap", "rounds"] = Field(
        "continuous", description="how turns reach the engine: continuous (env steps in a pool, the next turn joins "
        "the running batch lag_steps engine steps later; reproducible), asap (joins as soon as the tool returns; "
        "not reproducible), rounds (env steps inline, one engine call per turn); engines without a request feed "
        "run rounds")
    workers: int = Field(8, ge=1, description="threads stepping environments (continuous, asap); 1 = one step at "
                         "a time, for an env whose step is not thread-safe")
    lag_steps: int = Field(4, ge=0, description="continuous: engine steps between a turn's end and its next turn "
                           "joining the batch; a tool slower than that makes the engine wait (episode/stall_s)")


class AgentConfig(Section):
    """Agent programs as the episode source (docs/agentic.md): a Python function that calls an OpenAI-compatible
    chat endpoint, served the policy on loopback; the trainer sees exactly the tokens the engine sampled."""

    program: str | None = Field(None, description="'pkg.mod:fn', called fn(task, client) once per episode (sync or "
                                "async def); None = the task's own (data.task = 'verifiers:ID'), else no agent")
    concurrency: int = Field(64, ge=1, description="episodes running at once")
    timeout_s: float = Field(300.0, gt=0.0, description="wall-clock limit of one episode; a program over it fails "
                             "its sample (counted)")
    max_calls: int = Field(16, ge=1, description="chat calls per episode at most; more get HTTP 429 and the episode "
                           "ends without an answer unless the program returns one")
    on_mismatch: Literal["split", "drop"] = Field("split", description="a call whose prompt does not extend the "
                                                  "previous call's tokens (rewritten history): 'split' trains it as "
                                                  "another sample of the group, 'drop' leaves the episode out")
    batch_wait_s: float = Field(0.05, ge=0.0, description="how long a call waits for other running episodes' calls "
                                "to join its engine batch")
    max_body_mb: float = Field(32.0, gt=0.0, description="a chat call's JSON body at most (MiB), read only after "
                               "its key is checked; larger get 413")
    options: Options = Field(default_factory=dict, description="passed to the program as task.options")


class SandboxConfig(Section):
    """Running the policy's code (`code_tests`, `pyexec`; docs/sandbox.md)."""

    allow_unconfined: bool = Field(False, description="run code under rlimits only when bubblewrap is missing or "
                                   "cannot start (network and files stay visible); false = such a run stops")


class AlgoConfig(TablesSection, Section):
    """Objective by name (see docs/algorithms.md); `*_options` go to the named entry as keywords; `method` and
    `advantage` read their options from `[algo.<name>]`."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    method: str = Field("rl", description="the method of a run without [[stage]] tables (rollwise.methods), its "
                        "options in [algo.<method>]: rl; acrl, dcmdp, mipu; hargo, echorl, progress, sgrpo, "
                        "rorecomp, hrr, duet, tree, adhint (docs/seed_methods.md); or a plugin 'pkg.mod:Class'; a "
                        "teacher (teacher.weights) makes it opd / opsd")

    advantage: str = Field("grpo", description="grpo, dr_grpo, rloo, reinforce_pp, moa (outcome) or gae (critic)")
    loss: str = Field("ppo_clip", description="ppo_clip, dual_clip, gspo, cispo, sao, nsr, reinforce")
    loss_options: Options = Field(default_factory=dict, description="extra options, e.g. clip_c, rescue_prob")
    aggregation: str = "token_mean"
    norm_tokens: int | None = Field(None, gt=0, description="seq_mean_token_sum_norm constant; None = max_new_tokens")
    scale_rewards: Literal["group", "none"] = "group"
    clip_low: float = Field(0.2, ge=0.0)
    clip_high: float = Field(0.28, ge=0.0)
    kl_coef: float = Field(0.0, ge=0.0)
    kl_estimator: str = "k3"
    kl_in_reward: bool = Field(False, description="apply kl_coef as a reward penalty instead of a loss term")
    entropy_coef: float = Field(0.0, ge=0.0, description="entropy bonus: loss -= coef * aggregate(entropy)")
    is_correction: str = Field("none", description="engine-vs-trainer correction: none, tis_token, mis_token, "
                               "tis_seq, mis_seq, sis (needs train.old_logprobs = 'recompute')")
    is_options: Options = Field(default_factory=dict, description="e.g. cap, low, high")
    shaping: dict[str, Options] = Field(default_factory=dict, description="reward shaping by name -> options, "
                                        "e.g. overlong_soft = {cache_len = 16}; alp = {beta = 0.1}")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="gae discount")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="gae lambda")
    vf_coef: float = Field(0.5, ge=0.0, description="value-loss weight (gae only)")
    value_lr: float = Field(1e-3, gt=0.0, description="learning rate of the value head (a fresh layer)")
    value_clip: float | None = Field(0.2, gt=0.0, description="value-loss clip around old values; None = off")
    filter_zero_variance: bool = True


class EarlyStopConfig(Section):
    """`train.early_stop`: stop when an evaluation metric has not improved for `patience` evaluations, keeping
    the checkpoint of its best evaluation (`checkpoints/best`; rollwise/early_stop.py)."""

    metric: str = Field("eval/greedy_accuracy", description="an eval/ key: eval/greedy_accuracy, "
                        "eval/sampled_accuracy, eval/pass@K, eval/avg@K, eval/<source>/..., eval/response_len_mean")
    mode: Literal["max", "min"] = Field("max", description="max = higher is better")
    patience: int = Field(3, ge=0, description="evaluations in a row without an improvement before the run stops; "
                          "0 = never stop, only keep the best checkpoint")
    min_delta: float = Field(0.0, ge=0.0, description="an improvement must beat the best value by more than this")


class TrainConfig(Section):
    steps: int = Field(30, ge=0)
    max_time_s: float = Field(0.0, ge=0.0, description="stop after the step at which the RL steps' wall time "
                              "(evaluation excluded) reaches this; 0 = no limit")
    lr: float = Field(1e-5, gt=0.0)
    seed: int = 0
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = Field(1.0, gt=0.0)
    max_nonfinite_steps: int = Field(3, ge=1, description="a NaN/Inf loss or gradient skips the optimizer step; "
                                     "this many such RL steps in a row stop the run")
    ppo_epochs: int = Field(1, ge=1)
    minibatches_per_epoch: int = Field(1, ge=1)
    micro_batch_tokens: int = Field(1024, gt=0, description="token budget of one forward/backward")
    share_prompt: bool = Field(True, description="pack a prompt's responses in one row: the prompt is computed once")
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="recompute each decoder layer's activations in backward instead of keeping them "
        "(non-reentrant): far less activation memory for about one more forward pass; auto = on from about 1B "
        "parameters or when the memory estimate (rollwise train --dry-run) says the run would not fit without it")
    compile: bool = Field(False, description="torch.compile each decoder layer (dynamic shapes) for training; off "
                          "by default: on the CPU it measured 0.67x (benchmarks/train_step.py, BENCHMARKS.md)")
    precision: Literal["fp32", "bf16", "auto"] = Field(
        "fp32", description="bf16 = bf16 autocast with fp32 master weights; auto = bf16 on CUDA or where the CPU has "
        "native bf16")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="where the policy, reference, "
                        "critic and teacher live (the torch engine too): auto = cuda when a GPU is visible, else "
                        "cpu; cpu, cuda or cuda:N")
    backend: Literal["local", "fsdp2"] = Field(
        "local", description="local = one process; fsdp2 = PyTorch FSDP2 over train.world_size ranks (gloo on CPU, "
        "NCCL on GPU; ranks spawned here, by torchrun, or by Ray with cluster.ray)")
    world_size: int = Field(1, ge=1, description="fsdp2: trainer ranks (data-parallel, parameters sharded)")
    old_logprobs: Literal["behaviour", "recompute"] = Field(
        "recompute", description="PPO's old log-probs: 'recompute' = the trainer's own before the first update "
        "(free on a single on-policy update: no extra pass), 'behaviour' = the engine's sampling log-probs "
        "(never an extra pass)"
    )
    early_stop: EarlyStopConfig | None = Field(None, description="stop on an evaluation metric and keep the best "
                                               "checkpoint, e.g. {metric = 'eval/greedy_accuracy', patience = 3}")
    keep_best: bool = Field(True, description="keep checkpoints/best by held-out accuracy whenever evaluation runs "
                            "(eval.n > 0; eval/greedy_accuracy, else eval/sampled_accuracy); false = only the newest "
                            "checkpoints (train.early_stop keeps its own best either way)")
    trainable: str = Field("all", pattern=r"^(all|layers:\d+(-\d+)?(,\d+(-\d+)?)*)$", description="which parameters "
                           "train: 'all', or 'layers:A-B' (0-based decoder layers, e.g. 'layers:20-29' or "
                           "'layers:3,10-12'); everything else is frozen (no gradient, no optimizer state)")


class ControlConfig(Section):
    """Batch assembly: dynamic sampling, partial rollouts and the asynchronous mode (docs/guide.md)."""

    mode: Literal["sync", "async"] = Field(
        "sync", description="async = generation in its own process, overlapping training (bounded staleness)")
    dynamic_sampling: bool = Field(
        False, description="keep sampling prompts until prompts_per_step groups have reward variance (DAPO)")
    max_sampling_rounds: int = Field(4, ge=1, description="dynamic sampling: generation rounds per step at most")
    partial_rollouts: bool = Field(
        False, description="start over_provision x prompts_per_step groups, stop the rest once prompts_per_step "
        "are complete, and continue them next step (APRIL)")
    over_provision: float = Field(1.5, ge=1.0, description="partial rollouts: groups started per group needed")
    max_staleness: int = Field(1, ge=0, description="the oldest policy version trained on is current - "
                               "max_staleness (async mode; partial rollouts finish a response that old)")
    generation_threads: int = Field(0, ge=0, description="async: torch threads of the generation process; "
                                    "0 = half the physical cores (at least 1)")
    generation_device: str = Field("cpu", description="async: device of the generation process's engine")


class ReplayConfig(Section):
    """Replay of earlier samples into later batches, with importance correction (docs/guide.md)."""

    kind: Literal["none", "hard_case", "ssr"] = Field(
        "none", description="hard_case = low-reward groups with reward variance (ReRULE); "
        "ssr = selective sample replay of large-|advantage| samples (VL-Rethinker)")
    capacity: int = Field(64, gt=0, description="groups (hard_case) or samples (ssr) kept at most")
    max_age: int = Field(4, ge=0, description="policy versions a stored sample may age before it is evicted")
    mix_ratio: float = Field(0.25, ge=0.0, le=1.0, description="replayed share of a step's batch at most")
    hard_reward_threshold: float = Field(0.5, description="hard_case: keep groups with mean reward below this")
    min_abs_advantage: float = Field(0.0, ge=0.0, description="ssr: keep samples with |advantage| above this")
    max_uses: int = Field(1, ge=1, description="times one stored entry may be replayed")


class SyncConfig(Section):
    """How the trainer's weights reach the engines, and the check after every sync (docs/scale.md)."""

    transport: Literal["auto", "tensors", "safetensors", "nccl"] = Field(
        "auto", description="tensors = in-process copy (torch engine); safetensors = a folder the engine reloads "
        "(vLLM, CPU or GPU); nccl = vLLM's native GPU transfer; auto = the engine's natural one")
    check_tokens: int = Field(32, ge=0, description="tokens of a fixed probe sequence whose log-probs the engine "
                              "and the trainer compare after every sync (0 = off)")
    max_logprob_diff: float | None = Field(None, gt=0.0, description="a larger sync/logprob_max_abs_diff stops "
                                           "the run; None = 1e-2 for a float32 engine, 1.0 for bfloat16")


class ClusterConfig(Section):
    """Ray placement of engine workers and trainer ranks (docs/scale.md)."""

    ray: bool = Field(False, description="place engine workers and trainer ranks as Ray actors")
    address: str | None = Field(None, description="ray.init address; None = a local cluster bound to 127.0.0.1")
    engine_workers: int = Field(1, ge=1, description="engine actors (each a full engine; requests are split)")
    colocate: bool = Field(True, description="engine workers and trainer ranks share one placement group")
    resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0}, description="one bundle per "
                                        "engine worker and trainer rank, e.g. {CPU = 4, GPU = 1}")


class LoraConfig(Section):
    """LoRA adapters through PEFT: only the adapters train (docs/scale.md)."""

    rank: int = Field(0, ge=0, description="adapter rank; 0 = full fine-tuning")
    alpha: float = Field(32.0, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    save_merged: bool = Field(False, description="checkpoints also hold the merged model (loads without PEFT)")


class EvalConfig(Section):
    every_steps: int = Field(10, ge=0, description="0 = only at start and end")
    at_start: bool = Field(True, description="evaluate the starting model before step 1 (false: arms of one "
                           "comparison share one baseline evaluation)")
    n: int = Field(256, ge=0)
    temperature: float = Field(0.7, ge=0.0)
    max_new_tokens: int | None = Field(None, gt=0, description="None = rollout.max_new_tokens")
    greedy: bool = True
    k: int = Field(1, ge=1, description="sampled responses per prompt: with k > 1 evaluations report pass@j "
                   "(unbiased, Chen et al. 2021) for j = 1, 2, 4, ... < k and k, and avg@k")
    # `rollwise eval --decode deeplook` (rollwise.decode.deeplook): confidence-triggered lookahead and voting
    deeplook_segment_tokens: int = Field(8, ge=1, description="deeplook: tokens per segment, the unit of confidence")
    deeplook_drop_ratio: float = Field(0.9, gt=0.0, le=1.0, description="deeplook: look ahead when a segment's "
                                       "confidence < this x the mean of the last deeplook_window segments")
    deeplook_window: int = Field(4, ge=1, description="deeplook: recent segments the trigger compares with")
    deeplook_branches: int = Field(4, ge=2, description="deeplook: lookahead branches sampled at a trigger")
    deeplook_horizon_tokens: int = Field(16, ge=1, description="deeplook: tokens of each lookahead branch")
    deeplook_voters: int = Field(4, ge=1, description="deeplook: traces per prompt whose final answers are voted")
    deeplook_max_triggers: int = Field(4, ge=0, description="deeplook: lookaheads per trace at most")


class RunConfig(Section):
    name: str | None = None
    root: str = "runs"
    save_every_steps: int = Field(10, ge=0)
    keep_checkpoints: int = Field(0, ge=0, description="0 keeps all")
    samples_logged_per_step: int = Field(8, ge=0)
    report: bool = True
    console: bool = True
    trackers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl"], description="metric sinks; metrics.jsonl is always written")


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    stage: list[StageConfig] = Field(default_factory=list, description="[[stage]] tables: kind and steps, in order")
    # what loading changed and the run should say (rollwise.config_tasks: a task other than the recipe's)
    _load_notes: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _strategy_runs_here(self) -> "Config":  # rollout.strategy (rollwise/rollout_strategies/)
        name = self.rollout.strategy
        if name != "plain" and (self.control.mode != "sync" or self.rollout.source != "local"
                                or self.control.partial_rollouts or self.env.name is not None):
            raise ValueError(f"rollout.strategy = {name!r} runs its rounds on this process's engine: set "
                             "control.mode = 'sync', rollout.source = 'local', control.partial_rollouts = false "
                             "and no env.name (or rollout.strategy = 'plain')")
        return self

