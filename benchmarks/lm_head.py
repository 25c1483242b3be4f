"""The LM-head log-prob / entropy kernel, forward + backward, old (HEAD before the fused kernel) against new.

    python benchmarks/lm_head.py                       # [2000 tokens, H=576, V=49152], fp32 and bf16 autocast
    python benchmarks/lm_head.py --reps 5 --cases metric entropy_grad frozen

Both sides take the same leaves h [n, H] and weight [V, H] in the compute dtype (both requiring grad unless the
case is `frozen`), targets [n], and return (logp, entropy); the loss is sum(adv * logp) (+ 0.01 * sum(entropy) in
`entropy_grad`), as in the trainer: `metric` is its default (entropy computed and logged, without gradient),
`entropy_grad` an entropy bonus, `frozen` a head without gradient (LoRA). One timed call = forward + backward.
Calls alternate A B A B ... after one warm-up of each; reported: the median of each side and new / old.
The old kernel is a verbatim copy of `_HeadLogprob` as it was before the fused kernel (called per 512-row chunk
as `token_logprobs` did).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollwise.perf import cpu_model_name  # noqa: E402
from rollwise.train.logprobs import CHUNK_TOKENS, _HeadLogprob, row_chunks  # noqa: E402


class _OldHeadLogprob(torch.autograd.Function):
    """The kernel before: one chunk per call, fp32 [C, V] copies, ~10-pass recomputing backward (verbatim)."""

    @staticmethod
    def forward(ctx, h, weight, targets, with_entropy: bool, softcap: float | None = None):
        ctx.set_materialize_grads(False)
        ctx.softcap = softcap
        with torch.autocast(h.device.type, enabled=False):
            return _OldHeadLogprob._forward(ctx, h, weight, targets, with_entropy)

    @staticmethod
    def _forward(ctx, h, weight, targets, with_entropy: bool):
        logits = _old_capped((h @ weight.T).float(), ctx.softcap)  # [C, V]
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # [C]
        entropy = None
        if with_entropy:
            probs = torch.softmax(logits, dim=-1)
            entropy = -torch.bmm(probs[:, None, :], logp_all[:, :, None]).view(-1)  # -sum_j p_j log p_j
        ctx.save_for_backward(h, weight, targets)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        h, weight, targets = ctx.saved_tensors
        logits = _old_capped((h @ weight.T).float(), ctx.softcap)  # [C, V]
        probs = torch.softmax(logits, dim=-1)
        grad = None
        if grad_entropy is not None:
            logp_all = torch.log_softmax(logits, dim=-1)
            entropy = -torch.bmm(probs[:, None, :], logp_all[:, :, None]).view(-1)  # [C]
            grad = logp_all.add_(entropy[:, None]).mul_(probs).mul_(-grad_entropy[:, None])
        if grad_logp is not None:  # (onehot - p) * g, built in the probs buffer
            term = probs.mul_(-grad_logp[:, None]).scatter_add_(-1, targets[:, None], grad_logp[:, None])
            grad = term if grad is None else grad.add_(term)
        if grad is None:
            return None, None, None, None, None
        if ctx.softcap:  # d cap * tanh(z / cap) / dz = 1 - (logit / cap)^2
            grad.mul_(1 - (logits / ctx.softcap) ** 2)
        grad = grad.to(h.dtype)
        return grad @ weight, grad.T @ h, None, None, None


def _old_capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return logits if not softcap else torch.tanh(logits / softcap) * softcap


def old_head(h, weight, targets, with_entropy=True, softcap=None):
    logps, ents = [], []
    for rows in row_chunks(h.shape[0], CHUNK_TOKENS):
        lp, ent = _OldHeadLogprob.apply(h[rows], weight, targets[rows], with_entropy, softcap)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents) if with_entropy else None


def new_head(h, weight, targets, with_entropy=True, softcap=None):
    return _HeadLogprob.apply(h, weight, targets, with_entropy, softcap, CHUNK_TOKENS)




def one_call(fn, h, weight, targets, adv, case: str, dtype: torch.dtype) -> float:
    h.grad = weight.grad = None
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logp, entropy = fn(h, weight, targets, True)
        loss = (logp * adv).sum()
        if case == "entropy_grad":
            loss = loss + 0.01 * entropy.sum()
    loss.backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--reps", type=int, default=4, help="timed calls per side, alternating")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--cases", nargs="+", default=["metric"], choices=["metric", "entropy_grad", "frozen"])
    args = parser.parse_args(argv)
    print(f"CPU: {cpu_model_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"[{args.tokens} tokens, H={args.hidden}, V={args.vocab}], chunks of {CHUNK_TOKENS}", flush=True)
    gen = torch.Generator().manual_seed(0)
    results = []
    for name in args.dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        for case in args.cases:
            h = torch.randn(args.tokens, args.hidden, generator=gen).to(dtype).requires_grad_()
            weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.15).to(dtype)  # logits' std ~3.6
            weight.requires_grad_(case != "frozen")
            targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
            adv = torch.randn(args.tokens, generator=gen)
            sides = {"old": old_head, "new": new_head}
            times = {side: [] for side in sides}
            for side, fn in sides.items():  # warm-up
                one_call(fn, h, weight, targets, adv, case, dtype)
            for _ in range(args.reps):
                for side, fn in sides.items():
                    times[side].append(one_call(fn, h, weight, targets, adv, case, dtype))
            med = {side: statistics.median(v) for side, v in times.items()}
            row = {"dtype": name, "case": case, "median_s": {k: round(v, 3) for k, v in med.items()},
                   "ratio_new_over_old": round(med["new"] / med["old"], 3),
                   "speedup": round(med["old"] / med["new"], 2),
                   "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()}}
            results.append(row)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
