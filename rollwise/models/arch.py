"""What the engine and the trainer need to know about an architecture, read from the model itself.

A config carries keys its architecture may ignore (`num_key_value_heads` on GPT-NeoX, `sliding_window` on
Llama), so nothing here trusts the config alone:

- the KV geometry (layers with a cache, kv heads, key and value head dims) is read from the cache a 2-token
  forward fills;
- which layers attend through a sliding window is read from the masks the model builds: a 5-token forward
  with the config's window shrunk to 2 shows each windowed layer's last query seeing 2 keys instead of 5;
- the logits must be the LM head of the last hidden state, optionally soft-capped
  (`final_logit_softcapping`, Gemma 2): the trainer computes log-probs that way, so a model whose forward
  does anything else (a logit scale, ...) is refused.

`describe(model)` returns all of it as an `Architecture`; `head_logits(arch, model, hidden)` is the logits
of hidden states as the model's forward computes them. Attention-logit soft-capping
(`attn_logit_softcapping`, Gemma 2) is applied by eager attention only (transformers' SDPA path skips it):
`exact_attention(model)` switches such a model to eager.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollwise.errors import UserError

FULL, SLIDING = "full_attention", "sliding_attention"
_PROBE_WINDOW, _PROBE_TOKENS = 2, 5


class ArchitectureError(UserError, ValueError):
    """A model whose forward the torch engine or the trainer would not reproduce; the message says why."""


@dataclass(frozen=True)
class Architecture:
    """What `describe` read from a model.

    windows: per layer, the sliding window (keys visible to a query, itself included) or None.
    mask_keys: the model takes one mask per layer type (a dict keyed by `config.layer_types` values) when set.
    """

    model_type: str
    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    windows: tuple[int | None, ...]
    mask_keys: tuple[str, ...] | None
    logit_softcap: float | None
    attn_softcap: float | None

    @property
    def sliding(self) -> bool:
        return any(w is not None for w in self.windows)


def _name(model) -> str:
    cfg = model.config
    return f"model {getattr(cfg, 'name_or_path', '') or '(in memory)'} (model_type {cfg.model_type!r})"


def exact_attention(model) -> None:
    """Switch a model with attention-logit soft-capping to eager attention (SDPA would skip the cap)."""
    cfg = model.config
    if getattr(cfg, "attn_logit_softcapping", None) and cfg._attn_implementation == "sdpa":
        model.set_attn_implementation("eager")


def head_logits(arch: Architecture, model, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [..., V] of final hidden states [..., H], as the model's forward computes them."""
    logits = model.get_output_embeddings()(hidden)
    if arch.logit_softcap:
        logits = torch.tanh(logits / arch.logit_softcap) * arch.logit_softcap
    return logits


def logit_softcap(model) -> float | None:
    """The model's final-logit soft-cap (Gemma 2's `final_logit_softcapping`), or None."""
    return getattr(model.config, "final_logit_softcapping", None) or None


@torch.no_grad()
def describe(model) -> Architecture:
    """Read the KV geometry, sliding windows and logit transform of `model` (eval mode, any device)."""
    from transformers import DynamicCache

    from rollwise.models.compat import cache_kwargs

    cfg = model.config
    device = next(model.parameters()).device
    ids = torch.tensor([[0, 1]], dtype=torch.long, device=device)
    decoder = model.get_decoder()
    cache = DynamicCache()
    hidden = decoder(input_ids=ids, use_cache=True, **cache_kwargs(decoder, cache)).last_hidden_state
    shapes = {(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]) for layer in cache.layers}
    if len(cache.layers) != cfg.num_hidden_layers or len(shapes) != 1:
        raise ArchitectureError(
            f"{_name(model)}: {len(cache.layers)} of its {cfg.num_hidden_layers} layers keep a KV cache, with "
            f"shapes {sorted(shapes)}; the torch engine's slot cache needs one cache of one shape per layer. "
            "Use rollout.engine = 'vllm' for this architecture")
    (kv_heads, key_dim, value_dim), = shapes
    windows = _windows(model, decoder, cfg.num_hidden_layers)
    types = getattr(cfg, "layer_types", None)
    mask_keys = None
    if len({w for w in windows}) > 1:  # some layers windowed, others not: one mask per layer type
        if not types or set(types) != {FULL, SLIDING}:
            raise ArchitectureError(
                f"{_name(model)}: layers attend through different windows {sorted(set(windows), key=str)} and "
                f"config.layer_types is {types!r}, not full/sliding attention; the torch engine cannot build its "
                "masks. Use rollout.engine = 'vllm' for this architecture")
        mask_keys = (FULL, SLIDING)
    arch = Architecture(cfg.model_type, cfg.num_hidden_layers, kv_heads, key_dim, value_dim, windows, mask_keys,
                        logit_softcap(model), getattr(cfg, "attn_logit_softcapping", None) or None)
    _check_head(arch, model, ids, hidden)
    return arch


def _check_head(arch: Architecture, model, ids: torch.Tensor, hidden: torch.Tensor) -> None:
    """The forward's logits must be `head_logits` of the last hidden state (what the trainer computes)."""
    want = model(input_ids=ids, use_cache=False).logits.float()
    got = head_logits(arch, model, hidden).float()
    tol = 1e-3 if hidden.dtype == torch.float32 else 2e-2  # the same ops (bit-equal on the CPU in either dtype)
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max().clamp(min=1.0))):
        raise ArchitectureError(
            f"{_name(model)}: its logits are not its LM head applied to its last hidden state (max difference "
            f"{float((got - want).abs().max()):.3g}; e.g. a logit scale in config.json), so rollwise's trainer "
            "would compute other log-probs than the model. Not supported: use another checkpoint")


def _windows(model, decoder, layers: int) -> tuple[int | None, ...]:
    """Per layer: the sliding window the model applies (read from its masks, see the module docstring)."""
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return (None,) * layers
    seen = _layer_masks(model, decoder, window)
    out = []
    for i, allowed in enumerate(seen):
        visible = _PROBE_TOKENS if allowed is None else int(allowed[-1].sum())
        if visible == _PROBE_TOKENS:
            out.append(None)
        elif visible == _PROBE_WINDOW:
            out.append(int(window))
        else:
            raise ArchitectureError(
                f"{_name(model)}: layer {i} lets a query see {visible} of {_PROBE_TOKENS} keys under "
                f"sliding_window = {_PROBE_WINDOW}; the torch engine knows windows of exactly that many keys. "
                "Use rollout.engine = 'vllm' for this architecture")
    return tuple(out)


def _layer_masks(model, decoder, window: int) -> list[torch.Tensor | None]:
    """The [q, k] visibility (bool) of the last query each decoder layer receives for a 5-token input, under
    `sliding_window = 2`; None where the layer got no mask (plain causal attention)."""
    cfg = model.config
    blocks = getattr(decoder, "layers", None)
    if blocks is None or len(blocks) != cfg.num_hidden_layers:
        raise ArchitectureError(f"{_name(model)}: config.sliding_window is set and its decoder has no `layers` "
                                "list to read the masks from. Use rollout.engine = 'vllm' for this architecture")
    seen: list[torch.Tensor | None] = [None] * len(blocks)

    def hook(index):
        def capture(module, args, kwargs):
            masks = [m for m in (kwargs.get("attention_mask"), *args)  # by keyword, or the one 4-D argument
                     if isinstance(m, torch.Tensor) and m.dim() == 4]
            if masks:
                rows = masks[0][0, 0]  # [q, k]
                seen[index] = rows if rows.dtype == torch.bool else rows == 0
        return capture

    handles = [block.register_forward_pre_hook(hook(i), with_kwargs=True) for i, block in enumerate(blocks)]
    device = next(model.parameters()).device
    cfg.sliding_window = _PROBE_WINDOW
    try:
        ids = torch.zeros((1, _PROBE_TOKENS), dtype=torch.long, device=device)
        decoder(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    finally:
        cfg.sliding_window = window
        for handle in handles:
            handle.remove()
    return seen
