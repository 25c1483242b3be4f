"""How much memory a training run needs on its device: the estimate `rollwise train --dry-run` prints and
`train.gradient_checkpointing = "auto"` decides from (`rollwise.train.memory_config` builds it from a config).

Notation: T tokens of one micro-batch (`train.micro_batch_tokens`), L decoder layers, H hidden size, I MLP
(intermediate) size, nh attention heads, nkv key/value heads, d head dim, q = nh d, kv = nkv d, V vocabulary,
C = `rollwise.train.logprobs.CHUNK_TOKENS` LM-head rows, N parameters, N_t trainable parameters, N_lin the
decoder's linear weights (the LM head excluded), b_e the engine dtype's bytes. Bytes throughout.

Held for the whole run:
    weights      4 N                 fp32 master weights (FSDP2: / world_size)
    optimizer    8 N_t               AdamW's exp_avg and exp_avg_sq in fp32 (LoRA: adapters only; FSDP2: / ranks)
    reference    4 N (bf16 training: 2 N_lin + 4 (N - N_lin), its linears kept in bf16); algo.kl_coef > 0, no LoRA
    engine       b_e N (+ b_e N_lin: the CPU fused decoder's packed copy); a torch engine in this process

The training step (transient: gradients are set to None after each optimizer step):
    gradients    4 N_t
    s, saved tensors of one decoder layer per token (Llama-style block: RMSNorm, attention through a fused kernel
    that saves q, k, v, its output and a log-sum-exp, gated MLP; the residual stream stays fp32):
        fp32            s = 4 (6H + 2q + 2kv + 4I) + 4 nh + 8
                        (x, x/rms, norm out; h, h/rms, norm out; q, out; k, v; gate, up, silu, product)
        bf16 autocast   s = 16H + 2 (5H + 2q + 2kv + 4I) + 4 nh + 8
                        (x, x/rms, h, h/rms in fp32; q/k/v/gate/up each cast their input to bf16 separately)
        LoRA adds per adapted linear b r (its A output) and, in bf16, 2 in_features (a second cast of the input)
    outside the layers: o = 12H + 8d per token (final norm's x and x/rms, the gathered response states, rotary)
    activations  without checkpointing  A = T (L' s + o)        L' = layers that keep activations for backward
                 with checkpointing     A = T (L' 4H + o)       (each layer's fp32 input), and one layer, T s,
                                                                recomputed at a time during backward
    LM-head chunk  C V (16 + 2 [bf16])  four fp32 [C, V] buffers (logits, probabilities, log-probs, gradient)
    autocast copies (bf16)  2 (N_lin + V H)  the bf16 weights autocast makes in the forward
    backward buffers  3 T I b           gradients of one layer's [T, I] MLP tensors (b = 2 in bf16, else 4)
    step peak, without checkpointing: max(A + LM-head chunk + autocast copies,   the start of backward
                                          gradients + T s + backward buffers)    its end: one layer still kept
               with checkpointing:    max(A + autocast copies + max(LM-head chunk, T s + backward buffers),
                                          gradients + T s + backward buffers + 4 T H)   (the first layer's input)

Generation (transient, torch engine): the KV cache, slots x context x L x 2 nkv d x b_e, slots =
min(rollout.max_batch_size, requests of a step), context = prompt + response tokens + 1 (as
`rollwise.generate.torch_engine` sizes its `SlotCache`), plus the distinct prompts' prefill keys and values.

    total = held + max(step peak, generation)   (sync: the two alternate; an async engine on this device: +)

Measured against it (tests/test_memory.py): the step's peak on the CPU through torch's profiler, a 4-layer
model at 2048-token micro-batches, within the tolerance that test states. Not counted: a teacher model, a
value head, the allocator's fragmentation and the CUDA context (~0.5 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FP32_BYTES, BF16_BYTES = 4, 2
CHUNK_TOKENS_DEFAULT = 512  # rollwise.train.logprobs.CHUNK_TOKENS when it cannot be imported
AUTO_PARAMS = 1_000_000_000  # "auto" checkpointing is on from this many parameters
AUTO_HEADROOM = 0.9  # ... or when the estimate without it passes this share of the device's memory


@dataclass(frozen=True)
class ModelShape:
    """What the estimate reads of a model: its dimensions and parameter counts (tied weights once).

    `linears`: (module name, in_features, out_features) of every decoder `nn.Linear` (the LM head excluded);
    `layer_params`: parameters of each decoder layer."""

    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int
    linears: tuple[tuple[str, int, int], ...]
    layer_params: tuple[int, ...]

    @property
    def linear_params(self) -> int:
        return sum(i * o for _, i, o in self.linears)

    def adapted(self, targets: list[str]) -> list[tuple[str, int, int]]:
        """The linears LoRA targets (as PEFT matches a name list; ['all-linear'] = every one)."""
        if list(targets) == ["all-linear"]:
            return list(self.linears)
        return [lin for lin in self.linears if any(lin[0] == t or lin[0].endswith("." + t) for t in targets)]

    def lora_params(self, rank: int, targets: list[str]) -> int:
        return sum(rank * (i + o) for _, i, o in self.adapted(targets))


def shape_of(model: torch.nn.Module) -> ModelShape:
    """`ModelShape` of a causal LM (real weights, or built on the meta device); a PEFT model's base model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = base.config.get_text_config()
    head = base.get_output_embeddings()
    layers = getattr(base.get_decoder(), "layers", [])
    linears = tuple((name, m.in_features, m.out_features) for name, m in base.named_modules()
                    if isinstance(m, torch.nn.Linear) and m is not head and "lora_" not in name)
    heads = cfg.num_attention_heads
    return ModelShape(
        model_type=str(getattr(cfg, "model_type", "")), layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
        intermediate=getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size, heads=heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, vocab=cfg.vocab_size,
        params=sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n), linears=linears,
        layer_params=tuple(sum(p.numel() for n, p in layer.named_parameters() if "lora_" not in n)
                           for layer in layers))


@dataclass(frozen=True)
class StepSetup:
    """The training side of a run: what the trainer keeps and how one micro-batch runs.

    `trained_layers`: decoder layers whose parameters train (None = every parameter, embeddings included);
    `lora`: (rank, target modules) or None; `trainable_params`: the trained parameters when known (a live
    model), else counted from the shape."""

    tokens: int
    bf16: bool
    checkpointing: bool
    trained_layers: list[int] | None = None
    lora: tuple[int, list[str]] | None = None
    reference: bool = False
    world_size: int = 1
    chunk_tokens: int = CHUNK_TOKENS_DEFAULT
    trainable_params: int | None = None


@dataclass
class Estimate:
    """Bytes per part (`parts`, in table order) and how they add up (see the module docstring).

    `held`: names of the parts held for the whole run; `step_peak` / `generation`: the two transients;
    `total` = held + max(step peak, generation) (+ both when `concurrent`)."""

    parts: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    held: tuple[str, ...] = ("weights", "optimizer", "reference", "engine weights")
    step_peak: int = 0
    generation: int = 0
    concurrent: bool = False
    checkpointing: bool = False

    @property
    def held_bytes(self) -> int:
        return sum(self.parts.get(name, 0) for name in self.held)

    @property
    def total(self) -> int:
        transient = self.step_peak + self.generation if self.concurrent else max(self.step_peak, self.generation)
        return self.held_bytes + transient

    def as_dict(self) -> dict:
        """Every figure in GiB (for a JSON summary, e.g. benchmarks/gpu_check.py)."""
        gib = {name: value / 2**30 for name, value in self.parts.items()}
        return {"parts_gib": gib, "step_peak_gib": self.step_peak / 2**30, "generation_gib": self.generation / 2**30,
                "total_gib": self.total / 2**30, "checkpointing": self.checkpointing}


def layer_bytes_per_token(shape: ModelShape, bf16: bool, lora: tuple[int, list[str]] | None = None) -> int:
    """s: bytes one decoder layer keeps for backward per token (module docstring)."""
    H, I, q, kv = shape.hidden, shape.intermediate, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    small = 4 * shape.heads + 8  # log-sum-exp per head, two 1/rms
    if bf16:
        s = 16 * H + BF16_BYTES * (5 * H + 2 * q + 2 * kv + 4 * I) + small
    else:
        s = FP32_BYTES * (6 * H + 2 * q + 2 * kv + 4 * I) + small
    if lora is not None:  # per layer: each adapter's A output, and in bf16 its own cast of the input
        rank, targets = lora
        adapted = shape.adapted(targets)
        extra = len(adapted) * rank * (BF16_BYTES if bf16 else FP32_BYTES)
        extra += BF16_BYTES * sum(i for _, i, _ in adapted) if bf16 else 0
        s += extra // max(1, shape.layers)
    return s


def trainable_params(shape: ModelShape, setup: StepSetup) -> int:
    if setup.trainable_params is not None:
        return setup.trainable_params
    if setup.lora is not None:
        return shape.lora_params(*setup.lora)
    if setup.trained_layers is not None:
        return sum(shape.layer_params[i] for i in setup.trained_layers if i < len(shape.layer_params))
    return shape.params


def kept_layers(shape: ModelShape, setup: StepSetup) -> int:
    """L': layers whose activations backward needs (from the first trained one up, with frozen layers below)."""
    if setup.lora is None and setup.trained_layers:
        return shape.layers - min(setup.trained_layers)
    return shape.layers


def step_parts(shape: ModelShape, setup: StepSetup) -> dict[str, int]:
    """The training step's transient parts: gradients, activations, LM-head chunk, autocast copies, the
    recomputed layer and backward buffers (bytes)."""
    T, H = setup.tokens, shape.hidden
    act = BF16_BYTES if setup.bf16 else FP32_BYTES
    s = layer_bytes_per_token(shape, setup.bf16, setup.lora)
    layers = kept_layers(shape, setup)
    outside = T * (12 * H + 8 * shape.head_dim)
    saved = T * layers * (FP32_BYTES * H if setup.checkpointing else s) + outside
    return {
        "gradients": FP32_BYTES * trainable_params(shape, setup) // setup.world_size,
        "activations": saved,
        "lm-head chunk": min(T, setup.chunk_tokens) * shape.vocab * (16 + (BF16_BYTES if setup.bf16 else 0)),
        "autocast copies": BF16_BYTES * (shape.linear_params + shape.vocab * H) if setup.bf16 else 0,
        "one layer": T * s,
        "backward buffers": 3 * T * shape.intermediate * act,
    }


def step_peak(parts: dict[str, int], shape: ModelShape, setup: StepSetup) -> int:
    """max(start of backward, end of backward) of the step's transient parts (module docstring)."""
    layer = parts["one layer"] + parts["backward buffers"]
    if not setup.checkpointing:
        return max(parts["activations"] + parts["lm-head chunk"] + parts["autocast copies"],
                   parts["gradients"] + layer)
    start = parts["activations"] + parts["autocast copies"] + max(parts["lm-head chunk"], layer)
    return max(start, parts["gradients"] + layer + setup.tokens * FP32_BYTES * shape.hidden)


def reference_bytes(shape: ModelShape, bf16: bool) -> int:
    """The frozen KL reference: fp32, or with bf16 training its linear weights in bf16 (`Trainer`)."""
    if bf16:
        return BF16_BYTES * shape.linear_params + FP32_BYTES * (shape.params - shape.linear_params)
    return FP32_BYTES * shape.params


def training_estimate(shape: ModelShape, setup: StepSetup) -> Estimate:
    """Weights, optimizer, reference and the step's peak of the trainer (no engine)."""
    parts = step_parts(shape, setup)
    est = Estimate(checkpointing=setup.checkpointing)
    est.parts = {
        "weights": FP32_BYTES * shape.params // setup.world_size,
        "optimizer": 2 * FP32_BYTES * trainable_params(shape, setup) // setup.world_size,
        "reference": reference_bytes(shape, setup.bf16) if setup.reference and setup.lora is None else 0,
        **{k: v for k, v in parts.items() if k not in ("one layer", "backward buffers")},
    }
    est.step_peak = step_peak(parts, shape, setup)
    return est


def kv_cache_bytes(shape: ModelShape, slots: int, context: int, dtype_bytes: int) -> int:
    """A `SlotCache`: slots x context x layers x (keys + values) x kv heads x head dim x dtype."""
    return slots * context * shape.layers * 2 * shape.kv_heads * shape.head_dim * dtype_bytes


def decide_checkpointing(setting, params: int, need_without: int, available: int) -> tuple[bool, str]:
    """`train.gradient_checkpointing` resolved: (on, why). "auto" is on from `AUTO_PARAMS` parameters or when
    `need_without` (bytes without checkpointing) passes `AUTO_HEADROOM` of `available`."""
    if setting is True or setting is False:
        return setting, "set"
    if params >= AUTO_PARAMS:
        return True, f"auto: {params / 1e9:.2f}B parameters"
    if need_without > AUTO_HEADROOM * available:
        return True, f"auto: {gib(need_without)} GiB without it, {gib(available)} GiB available"
    return False, "auto: fits without it"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"
