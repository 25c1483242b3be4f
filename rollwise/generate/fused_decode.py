"""Fused prefill and decode for Llama-family models (Llama, Llama 3, Mistral, Qwen2, Qwen3; no sliding window).

The Hugging Face forward runs seven projections per layer, copies the KV cache for grouped-query attention
and builds a general masked attention for every layer. At decode time (one new token per slot, tens of
slots) those costs dominate on a CPU. This module runs the same arithmetic with:

- one `[hidden, q + k + v]` projection and one `[hidden, 2 * intermediate]` gate/up projection per layer,
  all projections with weights prepacked for oneDNN (`PackedLinear`), repacked on `refresh()`;
- projections and MLP on the active slots only;
- grouped-query attention as batched matmuls of `[slots, kv_heads, group, head_dim]` queries against the
  slot cache, without repeating keys and values, one additive mask per step shared by all layers, and the
  softmax in fp32;
- a prefill over right-padded contexts with causal SDPA, whose keys and values go to the slot cache.

Norms (Qwen3's per-head q/k norms included), embeddings and rotary tables are the model's own modules. Call
`refresh()` after changing the model's weights. Architectures this module does not reproduce exactly fall back
to the model's forward: `FusedDecoder.refusal` names what it refuses (another model type, an activation other
than SiLU, a sliding window, a rope type whose tables depend on the batch's positions, another layer layout);
tests/test_architectures.py checks each claimed type against the model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollwise.models.packed_linear import PackedLinear

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# rotary tables fixed by the config: "dynamic" and "longrope" pick theirs from the positions in the batch
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LAYER_MODULES = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTN_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj"}
_QK_NORMS = {"q_norm", "k_norm"}  # Qwen3: RMSNorm over each head before the rotation


class FusedDecoder:
    """Decode one token per slot against a `SlotCache`. Built from a `*ForCausalLM` model."""

    def __init__(self, model, rows_hint: int = 64):
        self.model = model
        self.rows_hint = rows_hint
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim**-0.5
        self.refresh()

    @staticmethod
    def supports(model, arch=None) -> bool:
        """True when the model's architecture is one this decoder reproduces exactly."""
        return FusedDecoder.refusal(model, arch) is None

    @staticmethod
    def refusal(model, arch=None) -> str | None:
        """Why this decoder would not reproduce `model` exactly, or None when it does. `arch`: the model's
        `rollwise.models.arch.describe` (read here when not given)."""
        cfg = model.config
        if next(model.parameters()).device.type != "cpu":
            return "prepacked oneDNN weights run on the CPU only"
        if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            return f"model_type {cfg.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
        if getattr(cfg, "hidden_act", None) != "silu":
            return f"hidden_act {getattr(cfg, 'hidden_act', None)!r} is not silu"
        rope = getattr(getattr(model.model, "rotary_emb", None), "rope_type", None)
        if rope not in STATIC_ROPE_TYPES:
            return f"rope type {rope!r} is not one of {STATIC_ROPE_TYPES}"
        if arch is None:
            from rollwise.models.arch import describe

            arch = describe(model)
        if arch.sliding:
            return f"sliding-window layers {arch.windows}"
        if arch.logit_softcap or arch.attn_softcap:
            return "soft-capped logits"
        for layer in model.model.layers:
            attn = {name for name, _ in layer.self_attn.named_children()}
            if {name for name, _ in layer.named_children()} != _LAYER_MODULES or not _ATTN_MODULES <= attn \
                    or attn - _ATTN_MODULES - (_QK_NORMS if cfg.model_type == "qwen3" else set()):
                return f"decoder layer modules {sorted(n for n, _ in layer.named_children())}, attention {sorted(attn)}"
            if {name for name, _ in layer.mlp.named_children()} != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
                return f"MLP modules {sorted(n for n, _ in layer.mlp.named_children())}"
        return None

    @torch.no_grad()
    def refresh(self) -> None:
        """Rebuild the fused (and packed) projection matrices from the model's current weights."""
        rows = self.rows_hint
        self.layers = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            self.layers.append({
                "ln1": layer.input_layernorm, "ln2": layer.post_attention_layernorm,
                "q_norm": getattr(attn, "q_norm", None), "k_norm": getattr(attn, "k_norm", None),
                "qkv": PackedLinear(torch.cat([p.weight for p in qkv]), _cat_bias(*qkv), rows),
                "o": PackedLinear(attn.o_proj.weight, attn.o_proj.bias, rows),
                "gate_up": PackedLinear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                                        _cat_bias(mlp.gate_proj, mlp.up_proj), rows),
                "down": PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias, rows),
            })
        head = self.model.get_output_embeddings()
        self.lm_head = PackedLinear(head.weight, head.bias, rows)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor):
        """Causal forward over right-padded contexts.

        input_ids: [U, L]; lengths: [U] real tokens per row (padding after them is never attended to by
        real tokens). Returns (logits at each row's last real token [U, vocab], per-layer (keys, values)
        [U, kv_heads, L, head_dim]).
        """
        body = self.model.model
        rows, width = input_ids.shape
        hidden = body.embed_tokens(input_ids).view(rows * width, -1)  # [U*L, H]
        positions = torch.arange(width, device=input_ids.device).repeat(rows)  # [U*L]
        cos, sin = self._rotary(hidden, positions)
        layer_kv = []
        for layer in self.layers:
            q, k, v = self._qkv(layer, layer["ln1"](hidden), cos, sin)  # [U*L, heads|kv, D]
            q, k, v = (t.view(rows, width, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
            hidden = hidden + layer["o"](out.transpose(1, 2).reshape(rows * width, -1))
            hidden = hidden + self._mlp(layer, layer["ln2"](hidden))
            layer_kv.append((k, v))
        last = hidden.view(rows, width, -1)[torch.arange(rows, device=hidden.device), lengths - 1]  # [U, H]
        return self.lm_head(body.norm(last)), layer_kv

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, rows: torch.Tensor) -> torch.Tensor:
        """One decode step for the active slots `rows` [A] of the cache.

        input_ids: [S] tokens to write at `positions` [S] (one column per slot, see `SlotCache.begin_step`).
        Projections and the MLP run on the A active rows only; attention runs over all S slots (the
        inactive ones with zero queries, their outputs dropped), which avoids gathering the cache.
        Returns next-token logits [A, vocab] in the model dtype.
        """
        body = self.model.model
        slots = input_ids.shape[0]
        hidden = body.embed_tokens(input_ids[rows])  # [A, H]
        cos, sin = self._rotary(hidden, positions[rows])
        bias = cache.attention_bias()  # [S, 1, 1, W] fp32: 0 where visible, -inf elsewhere
        every_slot = rows.shape[0] == slots
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, layer["ln1"](hidden), cos, sin)
            keys_t, values = cache.write(index, rows, k, v)  # [S, kv, D, W], [S, kv, W, D]
            hidden = hidden + layer["o"](self._decode_attention(q, keys_t, values, bias, rows, slots, every_slot))
            hidden = hidden + self._mlp(layer, layer["ln2"](hidden))
        return self.lm_head(body.norm(hidden))

    def _rotary(self, hidden, positions):
        """cos, sin [N, 1, D] for positions [N]."""
        cos, sin = self.model.model.rotary_emb(hidden, positions[None, :])  # [1, N, D]
        return cos[0, :, None, :], sin[0, :, None, :]

    def _qkv(self, layer, x, cos, sin):
        """x: [N, H] -> rotated q [N, heads, D], rotated k and v [N, kv_heads, D]."""
        qkv = layer["qkv"](x)  # [N, (heads + 2 kv) * D]
        qk_size = (self.heads + self.kv_heads) * self.head_dim
        qk = qkv[:, :qk_size].view(x.shape[0], -1, self.head_dim)
        if layer["q_norm"] is not None:  # Qwen3: per-head RMSNorm of q and k before the rotation
            qk = torch.cat((layer["q_norm"](qk[:, : self.heads]), layer["k_norm"](qk[:, self.heads :])), dim=1)
        qk = _rotate(qk, cos, sin)  # q and k in one pass
        return qk[:, : self.heads], qk[:, self.heads :], qkv[:, qk_size:].view(x.shape[0], -1, self.head_dim)

    def _decode_attention(self, q, keys_t, values, bias, rows, slots, every_slot) -> torch.Tensor:
        """q: [A, heads, D] against the cache (keys_t [S, kv, D, W], values [S, kv, W, D]) -> [A, heads * D]."""
        active, group = q.shape[0], self.heads // self.kv_heads
        q = (q * self.scale).reshape(active, self.kv_heads, group, self.head_dim)
        if not every_slot:
            q = q.new_zeros((slots, self.kv_heads, group, self.head_dim)).index_copy_(0, rows, q)
        scores = torch.matmul(q, keys_t) + bias  # [S, kv, group, W], fp32 (bias is fp32)
        out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [S, kv, group, D]
        if not every_slot:
            out = out[rows]
        return out.reshape(active, -1)

    @staticmethod
    def _mlp(layer, x) -> torch.Tensor:
        gate, up = layer["gate_up"](x).chunk(2, dim=-1)
        return layer["down"](F.silu(gate) * up)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (half-split convention). x: [S, heads, D]; cos, sin: [S, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _cat_bias(*linears) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias if lin.bias is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype,
                                                                                   device=lin.weight.device)
                      for lin in linears])
