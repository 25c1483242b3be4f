"""LoRA adapters through PEFT: only the adapters train, the frozen base doubles as the reference model.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") replaces each targeted linear
weight W [out, in] by W + (alpha / r) * B A, with A [r, in] (Kaiming-uniform init) and B [out, r] (zeros), so the
adapted model starts equal to the base. PEFT owns the layers; this module adds what the RL loop needs:

- `apply_lora(model, cfg.lora, seed)`: wrap the policy (deterministic adapter init, clear error on a target name
  that matches nothing); only adapter parameters require grad.
- The reference model for KL is the same network with adapters disabled (`with model.disable_adapter():`), so
  LoRA runs never hold a second copy of the base (`rollwise.train.lora_trainer.LoraTrainer` does this).
- `merged_state_dict(model)`: W + (alpha / r) B A under the plain model's parameter names, for engines that take
  full weights (the torch engine's `update_weights`), computed without merging the trained model in place.
- Checkpoints: `write_lora_checkpoint` / `load_lora_checkpoint`. Layout of a LoRA checkpoint directory:

```
step-N/adapter/   adapter_config.json, adapter_model.safetensors  (peft.PeftModel.from_pretrained(base, it))
step-N/merged/    config.json, model.safetensors, tokenizer files  (only with lora.save_merged: a plain HF
                  model that transformers and vLLM load as is)
step-N/           tokenizer files (+ trainer_state.pt, COMPLETE written by rollwise.train.checkpoint)
```
The root holds no `config.json` or model weights on purpose: loading it as a full model fails at once instead
of silently loading the merged weights and applying the adapter a second time on resume. Resume loads the base
from `cfg.model.name` and the adapter from `adapter/` (`load_lora_checkpoint`).

`peft` is an optional dependency: it is imported only when a function here needs it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from rollwise.models.atomic import fsync_tree, publish_dir

ADAPTER_DIR = "adapter"
MERGED_DIR = "merged"
ADAPTER_NAME = "default"  # PEFT's name for the single adapter


def _peft():
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("lora.rank > 0 needs PEFT: pip install 'rollwise[lora]' (or pip install peft)") from exc
    return peft


def is_lora(model) -> bool:
    """True for a PEFT-wrapped model (checked without importing peft)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


# -- building ----------------------------------------------------------------------------------------------

def linear_module_names(model) -> list[str]:
    """Sorted distinct last name components of the model's `nn.Linear` modules, the LM head excluded
    (e.g. ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'] for Llama)."""
    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head})


def _check_targets(model, targets: list[str]) -> None:
    """Raise ValueError when a target name matches no module (PEFT only complains when *none* match).

    A name matches as PEFT matches a list entry: the module's full name equals it or ends with '.' + it."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        from rollwise.config import ConfigError  # a user's key: one error line, exit 2

        raise ConfigError(f"lora.target_modules {missing} match no module of {type(model).__name__}; its linear "
                         f"modules are {linear_module_names(model)} (or use ['all-linear'])")


def apply_lora(model, lora_cfg, seed: int = 0):
    """Wrap `model` in a PEFT LoRA model (`lora_cfg`: rollwise.config.LoraConfig with rank > 0).

    The adapters are initialised from `seed` (the global torch RNG is left as it was), so two runs with the same
    seed start from the same A matrices; B starts at zero, so the wrapped model computes what `model` did. Only
    the adapter parameters require grad. `model` itself is modified (PEFT swaps its linear layers in place).
    """
    peft = _peft()
    if lora_cfg.rank <= 0:
        raise ValueError("apply_lora: lora.rank must be > 0 (0 means full fine-tuning)")
    targets = list(lora_cfg.target_modules)
    if targets == ["all-linear"]:
        target_modules = "all-linear"  # PEFT: every linear layer except the output head
    else:
        _check_targets(model, targets)
        target_modules = targets
    config = peft.LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                             target_modules=target_modules, task_type=peft.TaskType.CAUSAL_LM)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, config, adapter_name=ADAPTER_NAME)
    _check_only_adapters_train(wrapped)
    return wrapped


def _check_only_adapters_train(model) -> None:
    """Every parameter that requires grad must be an adapter's (`lora_` in its name), and there must be some."""
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    stray = [name for name in trainable if "lora_" not in name]
    if stray or not trainable:
        raise RuntimeError(f"LoRA model: expected only adapter parameters to train, got {stray[:3] or 'none'}")


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a (LoRA) model; tied tensors are counted once."""

    trainable: int
    total: int

    @property
    def fraction(self) -> float:
        return self.trainable / max(1, self.total)

    def line(self) -> str:
        """The startup line, e.g. 'LoRA: 4.88M trainable of 139.4M parameters (3.50%)'."""
        return (f"LoRA: {self.trainable / 1e6:.2f}M trainable of {self.total / 1e6:.1f}M parameters "
                f"({100 * self.fraction:.2f}%)")

    def metrics(self) -> dict[str, float]:
        return {"train/trainable_params": float(self.trainable), "train/total_params": float(self.total)}


def lora_info(model) -> ParamCounts:
    """Trainable and total parameter counts (works on any model; `named_parameters` skips tied duplicates)."""
    params = [p for _, p in model.named_parameters()]
    return ParamCounts(trainable=sum(p.numel() for p in params if p.requires_grad),
                       total=sum(p.numel() for p in params))


# -- merged weights ----------------------------------------------------------------------------------------

def _lora_layers(model) -> dict[str, object]:
    """Plain-model module name -> PEFT LoRA layer, for every adapted module of `model` (a PeftModel)."""
    peft = _peft()
    base = model.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}


@torch.no_grad()
def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """Full weights of a PEFT LoRA model with the active adapter folded in: W + (alpha / r) B A.

    Keys are the plain model's parameter names (those of the unwrapped model's `named_parameters()`, e.g.
    'model.layers.0.self_attn.q_proj.weight'; tied weights once), the names `TorchEngine.update_weights` and
    `save_pretrained` expect. Unadapted tensors are returned as detached views (no copy); adapted weights are new
    tensors. The trained model is not changed (no in-place merge). With adapters disabled (inside
    `disable_adapter()`) the base weights are returned.
    """
    layers = _lora_layers(model)
    base = model.get_base_model()
    out: dict[str, torch.Tensor] = {}
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        out[plain] = param.detach()
    for module_name, layer in layers.items():
        if layer.disable_adapters or layer.merged:  # merged: the base weight already holds the delta
            continue
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            if adapter in getattr(layer, "lora_variant", {}):
                raise NotImplementedError(f"merged_state_dict: {module_name} uses a LoRA variant (DoRA, ...); "
                                          "only plain LoRA is supported")
            key = f"{module_name}.weight"
            out[key] = out[key] + layer.get_delta_weight(adapter).to(out[key].dtype)
            if layer.lora_bias.get(adapter, False):
                bias_key = f"{module_name}.bias"
                out[bias_key] = out[bias_key] + layer.lora_B[adapter].bias * layer.scaling[adapter]
    return out


# -- saving and loading ------------------------------------------------------------------------------------

def _publish(tmp: Path, final: Path) -> None:
    """fsync `tmp` and rename it to `final` (an existing `final` is replaced safely)."""
    fsync_tree(tmp)
    publish_dir(tmp, final, final.parent / f".{final.name}.old-{os.getpid()}")


def _write_adapter(model, out_dir: Path) -> None:
    model.save_pretrained(str(out_dir), selected_adapters=[ADAPTER_NAME])


def _write_merged(model, out_dir: Path, tokenizer=None) -> None:
    """A plain HF model directory holding the merged weights (the trained model is left as it is)."""
    base = model.get_base_model()
    base.save_pretrained(str(out_dir), state_dict=merged_state_dict(model))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))


def _atomic_dir(final: Path, write) -> Path:
    """Run `write(tmp)` into a temp sibling of `final`, then publish it as `final`; return `final`."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def save_adapter(model, out_dir: str | Path) -> Path:
    """Write the PEFT adapter files of `model` to `out_dir` atomically (temp dir + rename).

    The directory loads with `peft.PeftModel.from_pretrained(base, out_dir)`; the vLLM engine passes it as a
    `LoRARequest`."""
    return _atomic_dir(Path(out_dir), lambda tmp: _write_adapter(model, tmp))


def save_merged(model, out_dir: str | Path, tokenizer=None) -> Path:
    """Write a full HF model (merged weights, config, generation config; the tokenizer when given) to `out_dir`
    atomically. It loads with `AutoModelForCausalLM.from_pretrained` and vLLM without PEFT."""
    return _atomic_dir(Path(out_dir), lambda tmp: _write_merged(model, tmp, tokenizer))


def write_lora_checkpoint(tmp_dir: str | Path, model, tokenizer, save_merged: bool) -> list[str]:
    """Write a LoRA checkpoint's model files into the (temporary) checkpoint directory `tmp_dir`.

    Writes the tokenizer at the root, the adapter under `adapter/` and, with `save_merged`, a plain HF model
    under `merged/` (see the module docstring). The caller (rollwise.train.checkpoint) adds trainer_state.pt,
    fsyncs and publishes the directory. Returns every file written, relative to `tmp_dir` (for the COMPLETE
    marker's size list), sorted.
    """
    root = Path(tmp_dir)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(root))
    _write_adapter(model, root / ADAPTER_DIR)
    if save_merged:
        _write_merged(model, root / MERGED_DIR, tokenizer)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def is_lora_checkpoint(ckpt_dir: str | Path) -> bool:
    """True when `ckpt_dir` holds a PEFT adapter under `adapter/`."""
    return (Path(ckpt_dir) / ADAPTER_DIR / "adapter_config.json").is_file()


def load_lora_checkpoint(ckpt_dir: str | Path, base_model, lora_cfg=None):
    """Resume: the PEFT model of base `base_model` (loaded from cfg.model.name) with the checkpoint's adapter.

    The adapter is trainable (only its parameters require grad), with the same parameter order as
    `apply_lora` gives, so a saved optimizer state loads onto it. With `lora_cfg`, a checkpoint whose rank,
    alpha or target modules differ from the config is refused.
    """
    peft = _peft()
    adapter_dir = Path(ckpt_dir) / ADAPTER_DIR
    if not is_lora_checkpoint(ckpt_dir):
        raise FileNotFoundError(f"{adapter_dir}: no adapter_config.json; this checkpoint was not written with "
                                "lora.rank > 0 (resume it with lora.rank = 0)")
    saved = peft.LoraConfig.from_pretrained(str(adapter_dir))
    if lora_cfg is not None:
        _check_same_adapter(saved, lora_cfg, adapter_dir)
    model = peft.PeftModel.from_pretrained(base_model, str(adapter_dir), adapter_name=ADAPTER_NAME,
                                           is_trainable=True)
    _check_only_adapters_train(model)
    return model


def _check_same_adapter(saved, lora_cfg, adapter_dir: Path) -> None:
    """Compare rank, alpha and (unless the config says 'all-linear', which PEFT saves resolved) the targets."""
    want = {"rank": lora_cfg.rank, "alpha": float(lora_cfg.alpha)}
    got = {"rank": saved.r, "alpha": float(saved.lora_alpha)}
    if list(lora_cfg.target_modules) != ["all-linear"]:
        saved_targets = saved.target_modules
        want["target_modules"] = sorted(lora_cfg.target_modules)
        got["target_modules"] = [saved_targets] if isinstance(saved_targets, str) else sorted(saved_targets)
    diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    if diff:
        raise ValueError(f"{adapter_dir}: the checkpoint's adapter differs from [lora] in the config "
                         f"(key: (checkpoint, config)) {diff}; resume with the checkpoint's [lora] settings")
