"""Log-probs of a fixed token sequence under a causal LM: the probe that checks a weight sync arrived.

    logp = model_probe_logprobs(model, token_ids)   # [len(token_ids) - 1] floats, temperature 1, fp32

`rollwise.sync` compares the engine's answer to the trainer's (`Trainer.probe_logprobs`, which calls this on
its model; FSDP2 runs it on every rank).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def model_probe_logprobs(model, token_ids: list[int]) -> list[float]:
    """Log-probs at temperature 1 of `token_ids[1:]` given the tokens before each, by `model` (fp32 out)."""
    was_training = model.training
    model.eval()
    try:
        ids = torch.tensor([token_ids], device=next(model.parameters()).device)
        logits = model(input_ids=ids).logits[0, :-1].float()  # [T-1, V]
        logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]  # [T-1]
    finally:
        model.train(was_training)
    return logp.tolist()
