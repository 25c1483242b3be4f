"""A frozen reference policy held by a method: the run's starting model, scoring sampled tokens.

HARGO (`rollwise.methods.hargo`) and the progress advantage (`rollwise.methods.progress`) read the reference
log-probs of the tokens the policy sampled. The trainer keeps its KL reference only when `algo.kl_coef > 0` and
does not hand it to methods, so a method that needs one holds its own: the starting model (`model.name`, as the
trainer's reference, also after a resume), loaded on first use onto the policy's device, in fp32 under the same
autocast and temperature as the trainer, so that at step 0 log pi / pi_ref is 0 up to float error.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from rollwise.train.batching import MicroBatch, collate, split_by_tokens
from rollwise.train.logprobs import token_logprobs
from rollwise.train.shared_attention import NAME as SHARED_ATTENTION
from rollwise.types import Sample


class FrozenReference:
    """`logprobs(mb) -> [S, T]` and `sample_logprobs(samples) -> [[T_i] per sample]` under the starting model."""

    def __init__(self, cfg, policy, tokenizer) -> None:
        self.cfg = cfg
        self.device = next(policy.parameters()).device if policy is not None else torch.device("cpu")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else getattr(tokenizer, "eos_token_id", 0)
        temperature = cfg.rollout.temperature
        self.temperature = temperature if temperature > 0 else 1.0
        self.model = None

    def _load(self):
        if self.model is None:
            from rollwise.models import load_model

            model, _ = load_model(self.cfg.model.name, dtype=torch.float32)
            model = model.eval().requires_grad_(False).to(self.device)
            if self.cfg.train.share_prompt:
                model.set_attn_implementation(SHARED_ATTENTION)
            self.model = model
        return self.model

    def _autocast(self):
        from rollwise.train.trainer import use_bf16

        if use_bf16(self.cfg.train.precision, self.device.type):
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    @torch.no_grad()
    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """Reference log-probs of `mb`'s response tokens: [S, T] (0 at padding), on `mb`'s device."""
        model = self._load()
        with self._autocast():
            logp, _ = token_logprobs(model, mb, self.temperature, with_entropy=False)
        return logp.float()

    def sample_logprobs(self, samples: list[Sample]) -> dict[int, torch.Tensor]:
        """id(sample) -> its reference log-probs [T_i] (on the CPU), for every sample of `samples`."""
        share = self.cfg.train.share_prompt
        out: dict[int, torch.Tensor] = {}
        for part in split_by_tokens(samples, self.cfg.train.micro_batch_tokens, share_prompt=share):
            mb = collate(part, self.pad_id, share_prompt=share).to(self.device)
            logp = self.logprobs(mb).cpu()
            for row, sample in enumerate(mb.samples):
                out[id(sample)] = logp[row, : len(sample.response_ids)]
        return out
