"""The training state behind `rollwise serve --api tinker`: one `TrainingModel` per Tinker training client.

A training client is a policy on the server's device (full fine-tuning, or PEFT LoRA as `rollwise.train.lora`
builds it), its AdamW optimizer, and a torch engine (`rollwise.generate.torch_engine.TorchEngine`, its own copy
of the weights) that its sampling clients sample from. What each Tinker call does, with rollwise's pieces:

- `forward_backward(data, loss_fn)`: per-token log-probs by the trainer's chunked LM-head kernel
  (`rollwise.train.logprobs.token_logprobs`), the Tinker loss summed over tokens, and `.backward()`; gradients
  accumulate until `optim_step`. The losses are Tinker's, per token (Tinker's docs): `cross_entropy`
  `-weights * logp`; `importance_sampling` `-exp(logp - sampling_logp) * A`, which is rollwise's `ppo_clip` with an
  unbounded band; `ppo` `-min(r A, clip(r, clip_low_threshold, clip_high_threshold) A)` (defaults 0.8, 1.2),
  which is `ppo_clip` with `clip_low = 1 - low`, `clip_high = high - 1`. Unlike rollwise's trainer nothing is
  normalised: the loss is the sum, as Tinker defines it (a client that wants a mean scales its weights or
  advantages).
- `optim_step(AdamParams)`: `torch.optim.AdamW` with the step's learning rate, betas, eps and decoupled weight
  decay, global-norm clipping when `grad_clip_norm > 0`, then the gradients are cleared.
- `save_weights_for_sampler`: a snapshot of the trainable tensors (the adapters under LoRA) kept in memory
  (`SNAPSHOTS_KEPT` per client); a sampler loads its snapshot into the engine (merged W + BA under LoRA,
  `rollwise.train.lora.merged_state_dict`) before it samples, so a sampling client keeps sampling the weights it
  was created with while training goes on.
- `save_state` / `load_state`: rollwise checkpoints (`rollwise.train.checkpoint.save_checkpoint`: written to a
  temp directory, fsynced, marked COMPLETE, renamed) under `STATE_DIR/<model id>/weights/<name>`, with the
  optimizer state and `tinker.json`-like metadata (base model, LoRA settings) in the trainer state, so a
  restarted server resumes a client's training from its path.
"""

from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from rollwise.serve.protocol import BadRequest
from rollwise.serve.tinker_wire import Datum, FwdBwdRequest, Sequence, SampleSpec, check_loss_inputs

SNAPSHOTS_KEPT = 4  # sampler snapshots kept per training client (older sampling clients are refused)
TOKENS_PER_PASS = 8192  # rows x longest row of one forward pass
LORA_ALPHA = 32.0
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:._-]{0,127}$")
KINDS = ("weights", "sampler_weights")


@dataclass(frozen=True)
class ModelSpec:
    """What a training client was created with; saved in every checkpoint it writes."""

    base_model: str
    rank: int  # 0 = full fine-tuning
    seed: int = 0
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


# -- paths ------------------------------------------------------------------------------------------------

def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def check_name(name, what: str = "name") -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadRequest(f"{what} {name!r} must be 1-128 letters, digits, '.', '_' or '-' (not starting with '.')")
    return name


def parse_path(path) -> tuple[str, str, str]:
    """`tinker://<model id>/<weights|sampler_weights>/<name>` -> (model id, kind, name)."""
    parts = path[len("tinker://"):].split("/") if isinstance(path, str) and path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not _MODEL_ID.match(parts[0]):
        raise BadRequest(f"path {path!r} is not a checkpoint path of this server (tinker://MODEL_ID/weights/NAME, "
                         "as save_state returns)")
    return parts[0], parts[1], check_name(parts[2])


def run_dir(root: Path, model_id: str, kind: str, name: str) -> Path:
    return Path(root) / model_id.replace(":", "+") / kind / name


def find_checkpoint(root: Path, path: str) -> Path:
    """The newest complete checkpoint directory saved under `path`; BadRequest when there is none."""
    from rollwise.train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir(root, *parse_path(path)))
    if ckpt is None:
        raise BadRequest(f"no saved state at {path} (save it with save_state(name) first; this server keeps "
                         f"them under {root})")
    return ckpt


def checkpoint_spec(ckpt: Path) -> tuple[ModelSpec, dict]:
    from rollwise.train.checkpoint import load_trainer_state

    state = load_trainer_state(ckpt)
    return ModelSpec(**state["tinker"]), state


# -- the model --------------------------------------------------------------------------------------------

def lora_targets(model, spec: ModelSpec) -> list[str]:
    """PEFT target modules for Tinker's switches; the LM head only when it is not tied to the embeddings."""
    from rollwise.train.lora import linear_module_names

    names = set(linear_module_names(model))
    targets = [t for t in (ATTN if spec.train_attn else []) + (MLP if spec.train_mlp else []) if t in names]
    if spec.train_unembed and not getattr(model.config, "tie_word_embeddings", False):
        targets.append("lm_head")
    if not targets:
        raise BadRequest(f"lora_config trains nothing on {type(model).__name__} (its linear modules: "
                         f"{sorted(names)})")
    return targets


def engine_dtype(device: torch.device) -> torch.dtype:
    from rollwise.hardware import bf16_is_native

    return torch.bfloat16 if device.type == "cuda" and bf16_is_native("cuda") else torch.float32


class TrainingModel:
    """One training client: policy, optimizer, sampler snapshots and the engine its samplers use."""

    def __init__(self, model_id: str, spec: ModelSpec, device: torch.device):
        from rollwise.config import LoraConfig
        from rollwise.generate.torch_engine import TorchEngine
        from rollwise.models.resolve import load_model, resolve_model_dir
        from rollwise.train.lora import apply_lora

        if spec.rank < 0:
            raise BadRequest(f"lora_config.rank must be >= 0 (0 = full fine-tuning), got {spec.rank}")
        self.model_id, self.spec, self.device = model_id, spec, device
        base, self.tokenizer = load_model(spec.base_model)
        self.model_dir = resolve_model_dir(spec.base_model)
        base.to(device)
        self.engine = TorchEngine(base, self.tokenizer, dtype=engine_dtype(device), seed=spec.seed)
        if spec.rank > 0:
            cfg = LoraConfig(rank=spec.rank, alpha=LORA_ALPHA, target_modules=lora_targets(base, spec))
            self.model = apply_lora(base, cfg, seed=spec.seed)
        else:
            self.model = base
        self.model.eval()  # no dropout: forward log-probs equal the sampler's at the same weights
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0  # optimizer steps taken
        self.snapshots: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.snapshot_count = 0
        self.loaded: int | None = None  # the snapshot the engine holds
        self.current: int | None = None  # the snapshot equal to the weights now (none after a step or a load)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 1_000_000)

    def info(self) -> dict:
        """`GetInfoResponse`: the tokenizer id is the local model directory, so `get_tokenizer()` loads it."""
        return {"type": "get_info", "model_id": self.model_id, "model_name": self.spec.base_model,
                "is_lora": self.spec.rank > 0, "lora_rank": self.spec.rank or None,
                "model_data": {"arch": type(self.model.get_base_model() if self.spec.rank else self.model).__name__,
                               "model_name": self.spec.base_model, "tokenizer_id": str(self.model_dir)}}

    # -- forward / backward ---------------------------------------------------------------------------
    def forward_backward(self, req: FwdBwdRequest) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per-datum `logprobs` and `elementwise_loss` ([n_i] each) and `loss:sum`; gradients accumulate unless
        `req.forward_only`."""
        from rollwise.train.logprobs import token_logprobs

        check_loss_inputs(req, self.vocab_size, self.context)
        loss_kwargs = loss_options(req.loss_fn, req.config)
        outputs, total = [], 0.0
        for group in token_groups(req.data):
            mb = micro_batch(group, self.tokenizer.pad_token_id or 0, self.device)
            with torch.set_grad_enabled(not req.forward_only), self._autocast():
                logp, _ = token_logprobs(self.model, mb, with_entropy=False)  # [S, T]
                per_token = tinker_loss(req.loss_fn, logp, group, mb.valid, loss_kwargs)  # [S, T]
                loss = per_token.sum()
            if not req.forward_only:
                loss.backward()
            total += float(loss.detach())
            lp, el = logp.detach().float().cpu().numpy(), per_token.detach().float().cpu().numpy()
            for i, d in enumerate(group):
                n = len(d.tokens)
                outputs.append({"logprobs": lp[i, :n], "elementwise_loss": el[i, :n]})
        return outputs, {"loss:sum": total}

    def _autocast(self):
        if self.device.type == "cuda" and engine_dtype(self.device) == torch.bfloat16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- optimizer --------------------------------------------------------------------------------------
    def optim_step(self, adam: dict) -> dict[str, float]:
        """One AdamW step with the SDK's `AdamParams` (learning_rate, beta1, beta2, eps, weight_decay,
        grad_clip_norm); the gradients are cleared afterwards."""
        lr, b1, b2 = adam_number(adam, "learning_rate", 1e-4), adam_number(adam, "beta1", 0.9), \
            adam_number(adam, "beta2", 0.95)
        eps, wd, clip = adam_number(adam, "eps", 1e-12), adam_number(adam, "weight_decay", 0.0), \
            adam_number(adam, "grad_clip_norm", 0.0)
        params = [p for _, p in self.named]
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        grads = [p for p in params if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(grads, clip if clip > 0 else float("inf"))) if grads else 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.current = None
        return {"grad_norm:mean": norm, "learning_rate:mean": lr}

    # -- samplers ---------------------------------------------------------------------------------------
    def snapshot(self) -> int:
        """Keep the current trainable tensors for a sampling client; returns its snapshot number."""
        self.snapshot_count += 1
        self.snapshots[self.snapshot_count] = {n: p.detach().to("cpu", copy=True) for n, p in self.named}
        while len(self.snapshots) > SNAPSHOTS_KEPT:
            self.snapshots.popitem(last=False)
        self.current = self.snapshot_count
        return self.snapshot_count

    def load_snapshot(self, number: int) -> None:
        """Put snapshot `number` into the engine (nothing to do when it holds it already)."""
        if self.loaded == number:
            return
        if number not in self.snapshots:
            raise BadRequest(f"this sampling client's weights are gone: the server keeps the last {SNAPSHOTS_KEPT} "
                             "sampler snapshots of a training client; create a new one with "
                             "save_weights_and_get_sampling_client()")
        with contextlib.nullcontext() if number == self.current else swapped(self.named, self.snapshots[number]):
            if self.spec.rank > 0:
                from rollwise.train.lora import merged_state_dict

                weights = merged_state_dict(self.model)
            else:
                weights = {n: p.detach() for n, p in self.model.named_parameters()}
            self.engine.update_weights(weights, number)
        self.loaded = number

    # -- checkpoints ------------------------------------------------------------------------------------
    def save(self, root: Path, kind: str, name: str, overwrite: bool) -> str:
        """Write a checkpoint atomically (weights, optimizer state, the spec); returns its tinker:// path."""
        from rollwise.train.checkpoint import latest_checkpoint, save_checkpoint
        from rollwise.train.lora import write_lora_checkpoint

        target = run_dir(root, self.model_id, kind, check_name(name))
        if not overwrite and latest_checkpoint(target) is not None:
            raise BadRequest(f"{tinker_path(self.model_id, kind, name)} exists: pass overwrite=True to replace it, "
                             "or use another name")
        state = {"tinker": asdict(self.spec), "optimizer": None if self.optimizer is None or kind != "weights"
                 else self.optimizer.state_dict()}
        extra = None
        if self.spec.rank > 0:
            def extra(tmp: Path) -> None:
                write_lora_checkpoint(tmp, self.model, self.tokenizer, save_merged=False)
        save_checkpoint(target, self.step, self.model, self.tokenizer, state, keep=1, write_extra=extra)
        return tinker_path(self.model_id, kind, name)

    def load(self, ckpt: Path, with_optimizer: bool) -> None:
        """Load a checkpoint's weights (and optimizer state) into this client; its base model and LoRA settings
        must be this client's. Pending gradients are dropped."""
        spec, state = checkpoint_spec(ckpt)
        if (spec.base_model, spec.rank) != (self.spec.base_model, self.spec.rank):
            raise BadRequest(f"the checkpoint was trained on {spec.base_model!r} with LoRA rank {spec.rank}; this "
                             f"training client is {self.spec.base_model!r} rank {self.spec.rank}: create a client "
                             "from it with create_training_client_from_state(path)")
        with torch.no_grad():
            if self.spec.rank > 0:
                _load_adapter(self.model, ckpt)
            else:
                from rollwise.models.resolve import load_model_dir

                loaded, _ = load_model_dir(ckpt)
                self.model.load_state_dict(loaded.state_dict())
        self.optimizer = None
        self.model.zero_grad(set_to_none=True)
        if with_optimizer and state.get("optimizer") is not None:
            params = [p for _, p in self.named]
            self.optimizer = torch.optim.AdamW(params)
            self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state.get("step", 0))
        self.loaded = self.current = None

    def close(self) -> None:
        self.engine.close()


def _load_adapter(model, ckpt: Path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from rollwise.train.lora import ADAPTER_DIR, ADAPTER_NAME

    weights = load_file(str(Path(ckpt) / ADAPTER_DIR / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights, adapter_name=ADAPTER_NAME)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise BadRequest(f"the checkpoint's adapter does not fit this model: unexpected tensors {unexpected[:3]}")


@contextlib.contextmanager
def swapped(named: list[tuple[str, torch.nn.Parameter]], values: dict[str, torch.Tensor]):
    """Temporarily hold `values` in the parameters (under no_grad), then put the current ones back."""
    with torch.no_grad():
        saved = [p.detach().clone() for _, p in named]
        for n, p in named:
            p.copy_(values[n])
        try:
            yield
        finally:
            for (_, p), old in zip(named, saved):
                p.copy_(old)


def adam_number(adam: dict, key: str, default: float) -> float:
    value = adam.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
        raise BadRequest(f"adam_params.{key} must be a finite number >= 0, got {value!r}")
    return float(value)


# -- the losses -----------------------------------------------------------------------------------------

def loss_options(loss_fn: str, config: dict[str, float]) -> dict:
    """rollwise `ppo_clip` options for Tinker's loss_fn_config (only `ppo` takes any)."""
    allowed = {"ppo": ("clip_low_threshold", "clip_high_threshold")}.get(loss_fn, ())
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise BadRequest(f"loss_fn_config keys {unknown} are not used by {loss_fn}"
                         + (f" (it takes {list(allowed)})" if allowed else " (it takes none)"))
    if loss_fn == "importance_sampling":
        return {"clip_low": float("inf"), "clip_high": float("inf")}
    if loss_fn == "ppo":
        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        if not 0.0 <= low <= 1.0 <= high:
            raise BadRequest(f"ppo needs clip_low_threshold <= 1 <= clip_high_threshold, got {low}, {high}")
        return {"clip_low": 1.0 - low, "clip_high": high - 1.0}
    return {}


def tinker_loss(loss_fn: str, logp: torch.Tensor, data: list[Datum], valid: torch.Tensor, options: dict):
    """Tinker's per-token loss [S, T] (0 on padding); summing it gives Tinker's loss."""
    from rollwise.algo.losses import ppo_clip

    def field(name: str) -> torch.Tensor:  # [S, T] float32, 0 on padding
        out = torch.zeros(logp.shape, dtype=torch.float32)
        for i, d in enumerate(data):
            out[i, :len(d.tokens)] = torch.from_numpy(np.array(d.inputs[name], dtype=np.float32))
        return out.to(logp.device)

    mask = valid.float()
    if loss_fn == "cross_entropy":
        weights = field("weights") if "weights" in data[0].inputs else mask
        return -weights * logp * mask
    loss, _ = ppo_clip(logp, field("logprobs"), field("advantages"), mask, **options)  # [S, T]
    return loss * mask


def token_groups(data: list[Datum], budget: int = TOKENS_PER_PASS) -> list[list[Datum]]:
    """Consecutive datums in groups whose rows x longest row stays within `budget` (one datum at least)."""
    groups, current, longest = [], [], 0
    for d in data:
        longest_with = max(longest, len(d.tokens))
        if current and longest_with * (len(current) + 1) > budget:
            groups.append(current)
            current, longest_with = [], len(d.tokens)
        current.append(d)
        longest = longest_with
    if current:
        groups.append(current)
    return groups


def micro_batch(data: list[Datum], pad_id: int, device: torch.device):
    """A rollwise `MicroBatch` in which every input position predicts its `target_tokens` entry: rows are the
    datums' inputs, right-padded; targets [S, T] are Tinker's target tokens."""
    from rollwise.train.batching import MicroBatch

    S, T = len(data), max(len(d.tokens) for d in data)
    input_ids = torch.full((S, T), pad_id, dtype=torch.long)
    targets = torch.zeros(S, T, dtype=torch.long)
    valid = torch.zeros(S, T, dtype=torch.bool)
    for i, d in enumerate(data):
        n = len(d.tokens)
        input_ids[i, :n] = torch.tensor(d.tokens)
        targets[i, :n] = torch.from_numpy(np.array(d.inputs["target_tokens"], dtype=np.int64))
        valid[i, :n] = True
    zeros = torch.zeros(S, T)
    mb = MicroBatch(samples=[], input_ids=input_ids, attention_mask=valid.long(),
                    position_ids=torch.arange(T).expand(S, T).contiguous(), targets=targets,
                    loss_mask=valid.float(), behaviour_logp=zeros, full_logp=zeros, valid=valid, current=valid,
                    pred_index=torch.arange(S * T).reshape(S, T), advantages=torch.zeros(S),
                    real_tokens=int(valid.sum()))
    return mb.to(device)


# -- sampling -------------------------------------------------------------------------------------------

def sample_many(engine, tokenizer, specs: list[SampleSpec], context: int) -> list:
    """Every spec's `num_samples` continuations by `engine` in ONE generate call, with their behaviour log-probs
    (under the distribution sampled from: temperature, top-k, top-p) and the prompt's log-probs when asked.
    Returns per spec `(sequences, prompt_logprobs or None)`, or the BadRequest that refused it. A seeded spec's
    samples share one generator (the caller never batches two specs with the same seed)."""
    from rollwise.types import GenerationRequest, SamplingParams, Status

    vocab = engine.model.get_input_embeddings().weight.shape[0]
    out: list = [None] * len(specs)
    requests, owner = [], []
    for k, spec in enumerate(specs):
        bad = [t for t in spec.prompt if not 0 <= t < vocab]
        if bad:
            out[k] = BadRequest(f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        elif len(spec.prompt) + spec.max_tokens > context:
            out[k] = BadRequest(f"the prompt ({len(spec.prompt)} tokens) + max_tokens ({spec.max_tokens}) is over "
                                f"the model's context of {context} tokens")
        if out[k] is not None:
            continue
        stops = tuple(spec.stop or ()) + tuple(tokenizer.decode([t], skip_special_tokens=False)
                                               for t in spec.stop_ids)
        params = SamplingParams(max_new_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                                top_k=spec.top_k, stop=stops, seed=spec.seed)
        for _ in range(spec.num_samples):
            requests.append(GenerationRequest(len(requests), list(spec.prompt), params))
            owner.append(k)
    sequences: dict[int, list[Sequence]] = {k: [] for k in range(len(specs))}
    for result, k in zip(engine.generate(requests) if requests else [], owner):
        sequences[k].append(Sequence(result.response_ids, result.logprobs, result.status == Status.COMPLETED))
    for k, spec in enumerate(specs):
        if out[k] is None:
            prompt_logprobs = [None] + engine.probe_logprobs(spec.prompt) if spec.prompt_logprobs else None
            out[k] = (sequences[k], prompt_logprobs)
    return out
