"""The validation step above parsing: every check across keys, and every registry name, before any work.

`rollwise.config_load.load_config` parses (keys, types, ranges); `validate(cfg)` checks what a run can do with it:

- keys that contradict each other (`run_errors`: off-policy sources without a correction, engines and
  transports that do not fit, scale-out combinations);
- method tables (`option_errors`: `[rollout.duet]`, `[algo.hargo]`, `[reward.cme]`; rollwise.config_methods);
- methods and stages (`rollwise.methods.checks`: teachers, `[[stage]]` tables, SFT data, TRB);
- registry names and plugins, data files, optional extras, the sandbox (`rollwise.names`).

It raises `ConfigError` with ONE line for the first problem. Every command calls it (`rollwise train`, `eval`,
`serve`, `--dry-run`), through `load` or on a config it changed.
"""

from __future__ import annotations

from pathlib import Path

from rollwise.config import Config, ConfigError
from rollwise.config_load import load_config


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Parse and validate: the config a command runs with (`ConfigError` on the first problem)."""
    return validate(load_config(path, overrides))


def validate(cfg: Config) -> Config:
    """`cfg` when it can run; ConfigError naming the first key that cannot (see the module docstring)."""
    from rollwise.generate.factory import resolve_engine
    from rollwise.methods.checks import method_errors
    from rollwise.names import resolve_names

    errors = option_errors(cfg)  # the selected methods' tables first: the rest reads them
    if not errors:
        resolve_engine(cfg, lambda c: run_errors(c) + method_errors(c))  # rollout.engine = "auto" made concrete
        errors = run_errors(cfg) + method_errors(cfg)
    if errors:
        raise ConfigError(errors[0])
    resolve_names(cfg)
    return cfg


def run_errors(cfg: Config) -> list[str]:
    """Contradictions between the run's own sections (not methods, not names)."""
    from rollwise.agents import agent_errors
    from rollwise.early_stop import early_stop_errors
    from rollwise.rewards import reward_setting_errors

    return [*_device_errors(cfg), *_objective_errors(cfg), *_off_policy_errors(cfg), *_scale_out_errors(cfg),
            *_tracker_errors(cfg), *early_stop_errors(cfg), *reward_setting_errors(cfg.reward),
            *agent_errors(cfg)]


def _device_errors(cfg: Config) -> list[str]:
    from rollwise.hardware import resolve_device

    try:
        resolve_device(cfg.train.device)
    except ValueError as exc:
        return [str(exc)]
    return []


def _objective_errors(cfg: Config) -> list[str]:
    from rollwise import algo

    errors = []
    a = cfg.algo
    if a.is_correction != "none" and cfg.train.old_logprobs == "behaviour":
        errors.append(f"algo.is_correction = {a.is_correction!r} corrects the gap between the engine's log-probs "
                      "and the trainer's old log-probs; set train.old_logprobs = 'recompute'")
    if algo.is_group_advantage(a.advantage) and cfg.rollout.samples_per_prompt < 2:
        errors.append(f"algo.advantage = {a.advantage!r} compares the samples of one prompt: "
                      "rollout.samples_per_prompt must be at least 2 (or use advantage = 'gae' with a critic)")
    if a.advantage == "progress":  # a token advantage the progress method feeds with reference log-probs
        errors.append("algo.advantage = 'progress' needs the reference's log-probs: set algo.method = 'progress' "
                      "and keep algo.advantage an outcome estimator (e.g. 'grpo')")
    return errors


def _off_policy_errors(cfg: Config) -> list[str]:
    from rollwise import algo

    control, replay, errors = cfg.control, cfg.replay, []
    sources = [name for name, on in [
        ("control.partial_rollouts", control.partial_rollouts),
        (f"replay.kind = {replay.kind!r}", replay.kind != "none"),
        ("control.mode = 'async' with max_staleness > 0", control.mode == "async" and control.max_staleness > 0),
    ] if on]
    if sources and cfg.algo.is_correction == "none":
        errors.append(f"{sources[0]} trains on tokens sampled by older policies: set algo.is_correction "
                      "(e.g. 'tis_token') to correct them with their stored behaviour log-probs")
    if control.partial_rollouts and control.max_staleness < 1:
        errors.append("control.partial_rollouts continues responses under the next policy version: "
                      "control.max_staleness must be at least 1")
    if control.mode == "async" and control.partial_rollouts:
        errors.append("control.partial_rollouts works with control.mode = 'sync' only (async mode already "
                      "overlaps the long tail with training)")
    if replay.kind != "none" and not algo.is_group_advantage(cfg.algo.advantage):
        errors.append(f"replay.kind = {replay.kind!r} replays stored outcome advantages; algo.advantage = "
                      f"{cfg.algo.advantage!r} has none (use an outcome estimator: {', '.join(algo.ADVANTAGES.names())})")
    return errors


def _scale_out_errors(cfg: Config) -> list[str]:
    rollout, train, sync, errors = cfg.rollout, cfg.train, cfg.sync, []
    if rollout.engine in ("sglang", "openai") and not (rollout.server or "").startswith(("http://", "https://")):
        errors.append(f"rollout.engine = {rollout.engine!r} is a client of a running server: set rollout.server "
                      "to its URL, e.g. 'http://127.0.0.1:30000'")
    if rollout.engine == "torch" and rollout.server is not None:
        errors.append("rollout.server is for the vllm, sglang and openai engines; the torch engine runs in-process "
                      "(remove rollout.server or set rollout.engine)")
    if rollout.engine != "torch" and cfg.control.mode == "async":
        errors.append(f"control.mode = 'async' runs the torch engine in a second process; with rollout.engine = "
                      f"{rollout.engine!r} use control.mode = 'sync'")
    if train.backend == "local" and train.world_size > 1:
        errors.append("train.world_size > 1 needs train.backend = 'fsdp2'")
    if sync.transport == "tensors" and rollout.engine != "torch":
        errors.append(f"sync.transport = 'tensors' copies weights in-process into the torch engine; rollout.engine = "
                      f"{rollout.engine!r} takes 'safetensors' or 'nccl' (or 'auto')")
    if cfg.lora.rank > 0 and train.backend == "fsdp2":
        errors.append("lora.rank > 0 trains adapters on one process: use train.backend = 'local' with LoRA (FSDP2 "
                      "shards full fine-tuning)")
    if cfg.cluster.ray and cfg.control.mode == "async":
        errors.append("cluster.ray places engines as Ray actors; control.mode = 'async' is the single-machine "
                      "generation process: use control.mode = 'sync'")
    if cfg.cluster.ray and rollout.engine in ("sglang", "openai"):
        errors.append(f"cluster.ray starts engines as Ray actors; rollout.engine = {rollout.engine!r} is a client of "
                      "a server you run yourself: set cluster.ray = false")
    if sync.transport in ("safetensors", "nccl") and rollout.engine == "torch":
        errors.append(f"sync.transport = {sync.transport!r} is for vLLM; the torch engine takes 'tensors' (or 'auto')")
    from rollwise.generate.vllm_options import vllm_option_errors
    from rollwise.generate.vllm_server import launch_option_errors

    launched = rollout.engine == "vllm" and rollout.server == "launch"
    return (errors + _weight_quant_errors(cfg) + _speculative_errors(cfg)
            + vllm_option_errors(rollout.engine, cfg.rollout.engine_options,
                                 server=rollout.server is not None)
            + (launch_option_errors(cfg.rollout.engine_options) if launched else []))


def _weight_quant_errors(cfg: Config) -> list[str]:
    """`rollout.engine_options.weight_quant`: a scheme of rollwise.generate.quantize, on the torch engine."""
    from rollwise.generate.quantize import SCHEMES

    quant = cfg.rollout.engine_options.get("weight_quant")
    if quant is None:
        return []
    if cfg.rollout.engine != "torch":
        return [f"rollout.engine_options.weight_quant is the torch engine's; with rollout.engine = "
                f"{cfg.rollout.engine!r} use that engine's own quantization option (vLLM: quantization = 'fp8')"]
    if quant not in SCHEMES:
        return [f"rollout.engine_options.weight_quant = {quant!r} is not one of {', '.join(SCHEMES)}"]
    if cfg.control.mode == "async":  # the engine process copies raw weights from shared memory: no re-quantizing
        return ["rollout.engine_options.weight_quant is not applied by the async engine process: set "
                "control.mode = 'sync', or remove weight_quant"]
    return []


def _speculative_errors(cfg: Config) -> list[str]:
    """`rollout.engine_options.draft_model` / `draft_tokens`: the torch engine's speculative decoding."""
    from rollwise.config import EMBEDDED_MODEL

    options = cfg.rollout.engine_options
    draft, k = options.get("draft_model"), options.get("draft_tokens")
    if draft is None and k is None:
        return []
    if cfg.rollout.engine != "torch":
        return [f"rollout.engine_options.draft_model is the torch engine's; with rollout.engine = "
                f"{cfg.rollout.engine!r} use that engine's speculative_config"]
    if draft is None:
        return ["rollout.engine_options.draft_tokens needs draft_model (a model dir sharing the policy's tokenizer)"]
    if cfg.control.mode == "async":  # the generation process builds a plain engine from the policy alone
        return ["rollout.engine_options.draft_model is not applied by the async engine process: set "
                "control.mode = 'sync', or remove draft_model"]
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        return [f"rollout.engine_options.draft_tokens = {k!r}: use an integer >= 1 (tokens proposed per round)"]
    local = isinstance(draft, str) and (Path(draft).expanduser() / "config.json").is_file()
    if not (local or draft == EMBEDDED_MODEL):
        return [f"rollout.engine_options.draft_model = {draft!r} is not a model directory (no config.json): use a "
                f"local HF model dir sharing the policy's tokenizer, or {EMBEDDED_MODEL!r}"]
    return []


def _tracker_errors(cfg: Config) -> list[str]:
    """Each tracker's library is importable now, not at the first step (its extra names the pip line)."""
    import importlib.util

    return [f"run.trackers: '{name}' is not installed; pip install 'rollwise[{name}]'"
            for name in cfg.run.trackers if name != "jsonl" and importlib.util.find_spec(name) is None]


def option_errors(cfg: Config) -> list[str]:
    """The method tables (rollwise.config_methods): the table of every method the run selects is valid and fits
    the run (its `errors(cfg)`), and no table is set for a method the run does not select. Each selected table
    is then written out in full (every key with its value), so `--dry-run` and config.toml show it."""
    from rollwise.config_methods import METHOD_SECTIONS, OPTION_MODELS

    try:
        selected = _selected_methods(cfg)
    except (KeyError, ValueError) as exc:
        return [str(exc).strip("'\"")]
    errors: list[str] = []
    for sec in METHOD_SECTIONS:
        section = getattr(cfg, sec)
        for name in list(section.model_extra or {}):
            entry = selected.get((sec, name))
            model = entry[1] if entry is not None else OPTION_MODELS.get((sec, name))
            if entry is None and not (model is not None and model.always):
                errors.append(f"[{sec}.{name}] is set but {_selection(cfg, sec)}: select {name!r} there, or remove "
                              f"[{sec}.{name}]")
            elif model is None:
                errors.append(f"[{sec}.{name}]: {entry[0]} {name!r} takes no options; remove [{sec}.{name}]")
        wrappers = {(sec, name): ("", model) for (sec, name), model in OPTION_MODELS.items()
                    if model.always and name in (section.model_extra or {})}
        for (s, name), (_, model) in {**wrappers, **selected}.items():
            if s != sec or model is None:
                continue
            try:
                options = model.of(cfg)
            except ConfigError as exc:
                errors.append(str(exc))
                continue
            errors += options.errors(cfg)
            if not errors:
                setattr(section, name, options.model_dump())  # a secret stays a SecretStr (masked in dumps)
    return errors


def _selected_methods(cfg: Config) -> dict[tuple[str, str], tuple[str, type | None]]:
    """`(section, name) -> (the key that selects it, its options model or None)` of every method of the run:
    rollout.strategy; the stages' kinds (algo.method) and algo.advantage; reward.fn and the mixture's rewards."""
    import rollwise.rewards.memreward  # noqa: F401  (reward wrappers: their tables register with them)
    import rollwise.rewards.noise  # noqa: F401
    from rollwise import algo
    from rollwise.methods.checks import method_classes
    from rollwise.rewards import get_reward_fn
    from rollwise.rollout_strategies import ROLLOUT_STRATEGIES

    out: dict[tuple[str, str], tuple[str, type | None]] = {}
    strategy = ROLLOUT_STRATEGIES.get(cfg.rollout.strategy)
    out[("rollout", cfg.rollout.strategy)] = ("rollout.strategy", getattr(strategy, "options", None))
    try:
        kinds = method_classes(cfg)
    except (KeyError, ValueError):
        kinds = []  # an unknown kind: the names check says so
    for kind, cls in kinds:
        out[("algo", kind)] = ("algo.method", getattr(cls, "options", None))
    advantage = cfg.algo.advantage
    for registry in (algo.ADVANTAGES, algo.TOKEN_ADVANTAGES):
        if advantage in registry.names() or (":" in advantage and registry is algo.ADVANTAGES):
            try:
                fn = registry.get(advantage)
            except (KeyError, ValueError):
                break
            if ("algo", advantage) not in out or out[("algo", advantage)][1] is None:
                out[("algo", advantage)] = ("algo.advantage", getattr(fn, "options", None))
            break
    for name in {cfg.reward.fn, *(s.reward for s in cfg.data.mix)} - {None}:
        try:
            fn = get_reward_fn(name)
        except Exception:
            continue  # an unknown reward: the names check says so
        out[("reward", name)] = ("reward.fn", getattr(fn, "options", None))
    return out


def _selection(cfg: Config, sec: str) -> str:
    """What selects a method in section `sec` now (for the message about a table no method reads)."""
    if sec == "rollout":
        return f"rollout.strategy = {cfg.rollout.strategy!r}"
    if sec == "reward":
        return f"reward.fn = {cfg.reward.fn!r}"
    kinds = [s.kind for s in cfg.stage]
    methods = f"the [[stage]] kinds are {kinds}" if kinds else f"algo.method = {cfg.algo.method!r}"
    return f"{methods} and algo.advantage = {cfg.algo.advantage!r}"
