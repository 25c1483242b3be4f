"""Per-token log-probabilities and entropy of response tokens, computed in chunks.

The `[tokens, vocab]` logits are never built for a whole micro-batch: hidden states of response
positions go through the LM head `chunk_tokens` at a time, and a custom autograd function recomputes
each chunk's logits in the backward pass instead of keeping them.
"""

from __future__ import annotations

import torch

from rollwise.models.arch import logit_softcap
from rollwise.train.batching import MicroBatch
from rollwise.train.shared_attention import NAME as SHARED_ATTENTION


def response_hidden(model, mb: MicroBatch) -> torch.Tensor:
    """Final hidden states at the positions that predict the valid response tokens.

    Returns [n, H] for the n valid tokens of `mb.valid` [S, T], in row-major order.
    """
    extra, mask = {}, mb.attention_mask
    if mb.layout is not None and model.config._attn_implementation == SHARED_ATTENTION:
        extra["shared_layout"] = mb.layout  # packed row: segments through one fused causal kernel, no mask
    elif mb.layout is not None:
        mask = mb.layout.dense_mask()  # [1, 1, L, L]: a model on another attention sees the same tokens
    hidden = model.get_decoder()(
        input_ids=mb.input_ids, attention_mask=mask, position_ids=mb.position_ids, use_cache=False, **extra,
    ).last_hidden_state  # [R, L, H]
    R, L, H = hidden.shape
    return hidden.reshape(R * L, H).index_select(0, mb.pred_index[mb.valid])  # [n, H]


CHUNK_TOKENS = 512  # response positions per LM-head call: one [CHUNK_TOKENS, V] fp32 logits block at a time


def row_chunks(n: int, chunk_tokens: int = CHUNK_TOKENS) -> list[slice]:
    """Slices over `n` rows, `chunk_tokens` at a time: how every `[rows, V]` LM-head computation is chunked
    (`token_logprobs` here, the GKD term in `rollwise.distill.terms`)."""
    return [slice(start, start + chunk_tokens) for start in range(0, n, chunk_tokens)]


class _Buffers:
    """`[rows, V]` work buffers by name for one pass over the chunks. On the CPU each is allocated once and reused by
    every chunk: a fresh 100-300 MB tensor is mapped anew and page-faults on first touch, which measured here about
    doubles the cost of an elementwise op over it. Elsewhere each call allocates (CUDA's caching allocator reuses)."""

    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.rows, self.vocab, self.device, self.keep, self.bufs = rows, vocab, device, device.type == "cpu", {}

    def __call__(self, name: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.keep:
            return torch.empty(rows, self.vocab, dtype=dtype, device=self.device)
        buf = self.bufs.get(name)
        if buf is None or buf.dtype != dtype:
            buf = self.bufs[name] = torch.empty(self.rows, self.vocab, dtype=dtype, device=self.device)
        return buf[:rows]


_aten = torch.ops.aten  # the out= forms of softmax / log_softmax (no public out= argument)


class _HeadLogprob(torch.autograd.Function):
    """Target-token log-probability and entropy through the LM head, `chunk_tokens` positions at a time.

    h [n, H], weight [V, H] (one dtype, the compute dtype: bf16 under autocast), targets [n] ->
    (logp [n], entropy [n] or None) in fp32. Logits z = h W^T are made in the compute dtype, one chunk
    [C, V] at a time; softmax reductions and everything after them run in fp32 (the input dtype's promotion
    with fp32). Saved for backward: h, weight, targets and O(n) rows (logp, entropy). No [C, V] tensor outlives
    a chunk: backward recomputes the chunk's logits once.

    Gradients, per row with upstream g (logp) and e (entropy):
      dz = g (onehot(t) - p) - e p (log p + H)     [d logp_t/dz = onehot - p; dH/dz_j = -p_j (log p_j + H)]
    - e absent (entropy only a metric, as in the trainer unless entropy_coef > 0): dz = -g (p - onehot).
      P' = p - onehot is one softmax in the compute dtype with the target entry set to expm1(logp_t) (exact
      where p_t ~ 1), and -g scales rows of the two [C, H]-sized matmul operands instead of a [C, V] pass.
    - e present: log p by log_softmax, p = exp(log p), then D = p (c - e log p) + g onehot with per-row
      c = -g - e H (one addcmul, one mul). log p + H is formed as the reference does: a shortcut through the
      saved log-sum-exp (z - lse, with lse = z_t - logp_t) lost up to 30x the fp32 reference's accuracy on
      unlikely targets (|logp_t| large), and a row max to avoid that would cost every forward a pass.
    - soft cap (Gemma 2's final_logit_softcapping, over temperature): z = cap tanh(x / cap) and dz/dx = 1 - tanh^2.
    - frozen head (weight without grad, h with: LoRA): with no soft cap, forward also computes A = P' W [C, H]
      and backward is grad_h = -g A with no recompute, unless the entropy has a gradient.

    Passes over [C, V] per chunk (one ATen kernel reading or writing a [C, V] tensor; matmuls and O(C)
    gathers/scatters not counted), before (HEAD) -> after, fp32 / bf16 compute:
      forward, logp only:          1 / 2   ->  1 / 2   (bf16: one copy into an fp32 chunk, log_softmax)
      forward, with entropy:       3 / 4   ->  4 / 5   (exp, mul_, sum replace softmax + bmm: one more
                                                        kernel, measured faster than the one bmm)
      backward, logp gradient:     2 / 4   ->  1 / 1   (one softmax in the compute dtype)
      backward, + entropy grad:    8 / 10  ->  4 / 6   (log_softmax, exp, addcmul, mul_; bf16: copy in, out)
      soft cap, forward:           +3      ->  +3      (div_, tanh_, mul_)
      soft cap, backward logp:     9 / 11  ->  6 / 8   (div_, tanh_, mul, softmax, square, addcmul; fp32)
      soft cap, + entropy grad:   15 / 17  ->  9 / 11
      backward, frozen head:       as above and 3 matmuls  ->  0 and 0, unless the entropy has a gradient
                                   (forward then makes 1 matmul more and up to 2 passes more)
    Before, every kernel also allocated a fresh [C, V] fp32 tensor (3 alive at once in forward); now the
    buffers are reused across chunks on the CPU (`_Buffers`), and the weight gradient is accumulated in place
    (addmm_) over chunks instead of one [V, H] tensor per chunk summed by autograd (which HEAD also computed
    for a frozen head).
    p comes from the softmax kernel, not exp(z - lse): at [512, 49152] on this CPU softmax(z) into a buffer
    took 48 ms against 62 ms for sub + exp (fp32; bf16 48 against 60), and exp's vectorised path slows on
    very negative inputs. In forward, where log p is already made, exp(log p) (36 ms) is used.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, with_entropy: bool, softcap: float | None = None,
                chunk_tokens: int = CHUNK_TOKENS):
        ctx.set_materialize_grads(False)
        ctx.softcap, ctx.chunk_tokens = softcap, chunk_tokens
        with torch.autocast(h.device.type, enabled=False):  # h and weight already share a dtype
            return _HeadLogprob._forward(ctx, h, weight, targets, with_entropy)

    @staticmethod
    def _forward(ctx, h, weight, targets, with_entropy: bool):
        n, V, cd, cap = h.shape[0], weight.shape[0], h.dtype, ctx.softcap
        acc = torch.promote_types(cd, torch.float32)
        logp = torch.empty(n, dtype=acc, device=h.device)
        entropy = torch.empty(n, dtype=acc, device=h.device) if with_entropy else None
        frozen = ctx.needs_input_grad[0] and not ctx.needs_input_grad[1] and not cap
        head_grad = torch.empty(h.shape, dtype=cd, device=h.device) if frozen else None  # A = P' W
        buf = _Buffers(min(n, ctx.chunk_tokens), V, h.device)
        for rows in row_chunks(n, ctx.chunk_tokens):
            hc, t = h[rows], targets[rows, None]
            C = hc.shape[0]
            zc = torch.mm(hc, weight.T, out=buf("zc", C, cd))
            z = zc if cd == acc else buf("z", C, acc).copy_(zc)
            if cap:
                _capped(z, cap)
            logp_all = _aten._log_softmax.out(z, 1, False, out=buf("logp", C, acc))
            lp = logp[rows] = logp_all.gather(1, t)[:, 0]
            if not (with_entropy or frozen):
                continue
            p = torch.exp(logp_all, out=z)  # z is spent
            if with_entropy:
                entropy[rows] = logp_all.mul_(p).sum(1).neg_()  # -sum_j p_j log p_j
            if frozen:
                _set_targets(p, t, torch.expm1(lp))  # P' = p - onehot(t)
                torch.mm(p if cd == acc else zc.copy_(p), weight, out=head_grad[rows])
        ctx.save_for_backward(h, weight, targets, logp, entropy, head_grad)
        return logp.float(), entropy.float() if with_entropy else None

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        h, weight, targets, logp, entropy, head_grad = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if (grad_logp is None and grad_entropy is None) or not (need_h or need_w):
            return None, None, None, None, None, None
        with torch.autocast(h.device.type, enabled=False):
            if head_grad is not None and grad_entropy is None:  # frozen head: the matmul was made in forward
                return (head_grad * -grad_logp[:, None]).to(h.dtype), None, None, None, None, None
            grad_h, grad_w = _HeadLogprob._backward(ctx, h, weight, targets, logp, entropy, grad_logp,
                                                    grad_entropy, need_h, need_w)
        return grad_h, grad_w, None, None, None, None

    @staticmethod
    def _backward(ctx, h, weight, targets, logp, entropy, grad_logp, grad_entropy, need_h, need_w):
        n, V, cd, cap = h.shape[0], weight.shape[0], h.dtype, ctx.softcap
        acc = logp.dtype
        grad_h = torch.empty(h.shape, dtype=cd, device=h.device) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        if grad_logp is None:
            grad_logp = torch.zeros(n, dtype=acc, device=h.device)
        buf = _Buffers(min(n, ctx.chunk_tokens), V, h.device)
        for rows in row_chunks(n, ctx.chunk_tokens):
            hc, t, g = h[rows], targets[rows, None], grad_logp[rows].to(acc)
            C = hc.shape[0]
            zc = torch.mm(hc, weight.T, out=buf("zc", C, cd))
            scale = None  # per-row factor of dz left to the [C, H] matmul operands
            if grad_entropy is None and not cap:  # dz = -g (p - onehot): p in the compute dtype, one pass
                d = _aten._softmax.out(zc, 1, False, out=buf("d", C, cd))
                _set_targets(d, t, torch.expm1(logp[rows]))
                scale = -g
            else:
                z = zc if cd == acc else buf("z", C, acc).copy_(zc)
                tanh = None
                if cap:
                    tanh = z.div_(cap).tanh_()
                    z = torch.mul(tanh, cap, out=buf("capped", C, acc))
                if grad_entropy is None:
                    d = _aten._softmax.out(z, 1, False, out=buf("p", C, acc))
                    _set_targets(d, t, torch.expm1(logp[rows]))
                    scale = -g
                else:  # dz = p (c - e log p) + g onehot, c = -g - e H
                    e = grad_entropy[rows].to(acc)
                    logp_all = _aten._log_softmax.out(z, 1, False, out=buf("logp", C, acc))
                    d = torch.exp(logp_all, out=z)  # z is spent (with a cap, tanh is in another buffer)
                    torch.addcmul((-g - e * entropy[rows])[:, None], logp_all, -e[:, None], out=logp_all)
                    d.mul_(logp_all).scatter_add_(1, t, g[:, None])
                if cap:  # d cap tanh(x / cap) / dx = 1 - tanh^2
                    d.addcmul_(d, tanh.mul_(tanh), value=-1)
                if cd != acc:
                    d = zc.copy_(d)  # zc is spent
            if need_h:
                if scale is None:
                    torch.mm(d, weight, out=grad_h[rows])
                else:
                    torch.mul(torch.mm(d, weight), scale[:, None], out=grad_h[rows])
            if need_w:
                grad_w.addmm_(d.T, hc if scale is None else (hc * scale[:, None]).to(cd))
        return grad_h, grad_w


def _set_targets(d: torch.Tensor, t: torch.Tensor, values: torch.Tensor) -> None:
    """d[i, t[i, 0]] = values[i]. Not `scatter_`, which on the CPU converts a whole bf16 [C, V] tensor (100 ms)."""
    d.index_put_((torch.arange(d.shape[0], device=d.device), t[:, 0]), values.to(d.dtype))


def _capped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """cap * tanh(logits / cap), in place: 3 passes over [C, V]."""
    return logits.div_(softcap).tanh_().mul_(softcap)


_LIGER = []  # [the liger-kernel fused linear cross-entropy, or None], filled on first use


def _liger_linear_ce():
    """liger-kernel's `liger_fused_linear_cross_entropy` when installed (`pip install rollwise[liger]`), else None.
    0.8.2 or later only: before it, reduction="none" scaled the weight gradient after summing over tokens."""
    if not _LIGER:
        try:
            from importlib.metadata import version

            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
            from packaging.version import Version

            recent = Version(version("liger-kernel")) >= Version("0.8.2")
            _LIGER.append(liger_fused_linear_cross_entropy if recent else None)
        except Exception:  # not installed, or no triton / GPU stack to import it with
            _LIGER.append(None)
    return _LIGER[0]


def head_kernel(device: torch.device, with_entropy: bool, liger_available: bool | None = None) -> str:
    """Which LM-head log-prob kernel `token_logprobs` runs: "liger" or "own".

    liger-kernel's fused linear cross-entropy (reduction="none") returns -log p(target) in fp32 from
    compute-dtype logits with its gradient, soft cap included, but no entropy: so it is used on CUDA for
    log-probs without entropy only (the old-policy and reference passes); the training pass, which
    returns the entropy, runs the own chunked kernel (`_HeadLogprob`) on every device.
    """
    if device.type != "cuda" or with_entropy:
        return "own"
    if liger_available is None:
        liger_available = _liger_linear_ce() is not None
    return "liger" if liger_available else "own"


def token_logprobs(
    model, mb: MicroBatch, temperature: float = 1.0, chunk_tokens: int = CHUNK_TOKENS, with_entropy: bool = True,
    hidden_out: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropies) of the response tokens under `model`.

    Logits are divided by `temperature` (the rollout temperature) so that the trainer's distribution
    matches the one the engine sampled from; the division is applied to the hidden states, which is the
    same and `vocab / hidden` times cheaper. Returns (logp [S, T], entropy [S, T] or None); values at
    padded positions are 0. With `hidden_out`, the final hidden states [n, H] of the predicting positions are
    appended to it (for a value head).
    """
    flat_h = response_hidden(model, mb)  # [n, H]
    if hidden_out is not None:
        hidden_out.append(flat_h)
    if temperature != 1.0:
        flat_h = flat_h / temperature
    flat_t = mb.targets[mb.valid]  # [n]
    weight = model.get_output_embeddings().weight  # [V, H]
    device = flat_h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    flat_h, weight = flat_h.to(dtype), weight.to(dtype)
    cap = logit_softcap(model)  # on logits / temperature: cap * tanh(z / cap) / T = (cap / T) tanh((z / T) / (cap / T))
    softcap = cap / temperature if cap else None
    if flat_h.shape[0] and head_kernel(flat_h.device, with_entropy) == "liger":  # CUDA, liger installed, no entropy
        with torch.autocast(device, enabled=False):
            flat_logp = -_liger_linear_ce()(flat_h, weight, flat_t, reduction="none", softcap=softcap)
        flat_ent = None
    else:  # chunks of chunk_tokens rows inside
        flat_logp, flat_ent = _HeadLogprob.apply(flat_h, weight, flat_t, with_entropy, softcap, chunk_tokens)
    S, T = mb.targets.shape
    logp = torch.zeros(S, T, dtype=torch.float32, device=mb.device).masked_scatter(mb.valid, flat_logp)
    if not with_entropy:
        return logp, None
    return logp, torch.zeros(S, T, dtype=torch.float32, device=mb.device).masked_scatter(mb.valid, flat_ent)
