"""CME (Cross-Model Entropy): a label-free reward, the mean log-likelihood per token of the response under a
separate verifier model (`reward.fn = "cme"`, `reward.cme.model`).

    r_i = (1 / |y_i|) * sum_t log p_V(y_i,t | x_i, y_i,<t)        (a negative number; higher = more plausible)

where `V` is the verifier model, `x_i` the prompt as `V`'s chat template writes it and `y_i` the response text
re-tokenised by `V`'s tokenizer. No reference answer is read for the reward.

Paper: Cross-Model Entropy (CME) as a label-free reward (see the seeds' abstracts). What this fills in where the
abstract is silent, and why:
- The verifier is any causal LM directory (`rollwise.models.load_model`: a local HF directory, a hub id or the
  embedded SmolLM2), loaded once on first use, frozen, on the CPU in float32. It need not share the policy's
  tokenizer: the response *text* is re-tokenised, so log-likelihoods are per verifier token. (The teacher in
  `rollwise.distill` scores the sampled ids as they are and needs the policy's tokenizer; CME does not.)
- The likelihood is conditioned on the prompt (the abstract's "under the verifier" reads most naturally as
  p(response | prompt)); the prompt is the task's messages (`Prompt.messages`), without the run's
  `data.system_prompt`, which is the policy's instruction, not part of the question. An empty response has no
  token to score (its end-of-turn token alone would be an arbitrary score): it is a failed reward (counted).
- Label-free means the reward never reads `prompt.answer`. For accuracy metrics and held-out evaluation a verdict
  can still be recorded by `reward.cme.verifier` (a verifier name such as "arith"): it sets `correct` and the part
  `correct`, never the value.

Batching: `score_many(samples, timeout_s)` packs `reward.cme.batch_size` responses per forward (right padded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pydantic import Field

from rollwise.config import RewardConfig
from rollwise.config_methods import MethodOptions
from rollwise.rewards.calling import as_result, decide_correct, get_reward_fn
from rollwise.types import RewardResult, Sample


class CMEOptions(MethodOptions, section="reward", name="cme"):
    """`[reward.cme]` (with `reward.fn = "cme"`): Cross-Model Entropy, a label-free reward from a second model."""

    model: str | None = Field(None, description="the verifier model (a local HF directory, a hub id or "
                              "'smollm2-135m-instruct') whose mean log-likelihood per response token is the reward")
    verifier: str | None = Field(None, description="a verifier (e.g. 'arith') whose verdict is recorded as `correct` "
                                 "for accuracy metrics and held-out evaluation, never the reward; None = no verdict "
                                 "(accuracy reads 0)")
    batch_size: int = Field(16, ge=1, description="responses scored by the verifier model in one forward")


class CMEReward:
    """The CME reward of `reward.cme.model` (see the module docstring); build with `from_config(reward_cfg)`."""

    def __init__(self, model_name: str, batch_size: int = 16, verifier: str | None = None,
                 loaded: tuple[Any, Any] | None = None) -> None:
        self.model_name = model_name
        self.batch_size = batch_size
        self.verifier = get_reward_fn(verifier) if verifier else None
        self._loaded = loaded  # (model, tokenizer), loaded on first use
        self.__name__ = "cme"

    def _model(self) -> tuple[Any, Any]:
        if self._loaded is None:
            from rollwise.models import load_model

            self._loaded = load_model(self.model_name, torch.float32)
        return self._loaded

    def __call__(self, sample: Sample) -> RewardResult:
        outcome = self.score_many([sample], None)[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def encode(self, sample: Sample) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) under the verifier's tokenizer; ValueError for an empty response."""
        _, tok = self._model()
        if not sample.response_text.strip():
            raise ValueError("cme: the response is empty (no tokens for the verifier to score)")
        messages = [{"role": m["role"], "content": m["content"]} for m in sample.prompt.messages]
        if getattr(tok, "chat_template", None):
            prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "input_ids"):
                prompt_ids = prompt_ids["input_ids"]
        else:
            prompt_ids = tok("\n".join(m["content"] for m in messages) + "\n", add_special_tokens=True)["input_ids"]
        response_ids = tok(sample.response_text, add_special_tokens=False)["input_ids"]
        if not response_ids:
            raise ValueError("cme: the response has no tokens under the verifier's tokenizer")
        return list(prompt_ids), list(response_ids)

    @torch.no_grad()
    def mean_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
        """Mean log p_V(response token | prefix) of each (prompt ids, response ids) pair, `batch_size` at a time."""
        model, tok = self._model()
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        out: list[float] = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start:start + self.batch_size]
            rows = [p + r for p, r in chunk]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [B, L]
            attention = torch.zeros((len(rows), width), dtype=torch.long)  # [B, L]
            target_mask = torch.zeros((len(rows), width), dtype=torch.float32)  # [B, L]: response positions
            for i, ((p, r), row) in enumerate(zip(chunk, rows)):
                ids[i, :len(row)] = torch.tensor(row)
                attention[i, :len(row)] = 1
                target_mask[i, len(p):len(row)] = 1.0
            logits = model(input_ids=ids, attention_mask=attention).logits.float()  # [B, L, V]
            logp = torch.log_softmax(logits[:, :-1], dim=-1)  # [B, L-1, V]: predicts positions 1..L-1
            token_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, L-1]
            mask = target_mask[:, 1:]  # [B, L-1]
            out.extend(((token_logp * mask).sum(-1) / mask.sum(-1)).tolist())
        return out

    def score_many(self, samples: list[Sample], timeout_s: float | None) -> list[RewardResult | BaseException]:
        """One outcome per sample, in order: a RewardResult, or the exception of a sample that cannot be scored
        (counted as a failed reward by `rollwise.rewards.score_batch`). `timeout_s` is not enforced: a forward
        of the local verifier cannot be interrupted safely."""
        outcomes: list[RewardResult | BaseException | None] = [None] * len(samples)
        pairs, where = [], []
        for i, sample in enumerate(samples):
            try:
                pairs.append(self.encode(sample))
                where.append(i)
            except Exception as exc:
                outcomes[i] = exc
        for i, value in zip(where, self.mean_logprobs(pairs)):
            outcomes[i] = self._result(samples[i], value)
        return outcomes  # type: ignore[return-value]

    def _result(self, sample: Sample, value: float) -> RewardResult | BaseException:
        parts = {"cme_logp": value}
        correct, info = None, {}
        if self.verifier is not None:
            try:
                verdict = as_result(self.verifier(sample))
            except Exception as exc:
                return exc
            correct, info = decide_correct(verdict), verdict.info  # the verifier's extracted answer, if any
            parts["correct"] = 1.0 if correct else 0.0
        return RewardResult(value=value, parts=parts, correct=correct, info=info)


def from_config(cfg: RewardConfig) -> CMEReward:
    o = CMEOptions.of(cfg)
    return CMEReward(o.model, o.batch_size, o.verifier)


def config_errors(cfg: RewardConfig) -> list[str]:
    """What keeps `reward.fn = "cme"` from running (checked at --dry-run)."""
    from rollwise.models import check_model_source

    o = CMEOptions.of(cfg)
    if not o.model:
        return ["reward.fn = 'cme' needs reward.cme.model: set it to the verifier model (a local HF directory, a "
                "hub id or 'smollm2-135m-instruct')"]
    errors = []
    path = Path(o.model).expanduser()
    if o.model.startswith(("/", ".", "~")) and not (path / "config.json").is_file():
        errors.append(f"reward.cme.model = {o.model!r} is not a model directory (no config.json there): "
                      "set it to a saved HF model directory")
    try:
        check_model_source(o.model)
    except Exception as exc:
        errors.append(f"reward.cme.model = {o.model!r}: {exc}")
    if o.verifier:
        try:
            get_reward_fn(o.verifier)
        except Exception as exc:
            errors.append(f"reward.cme.verifier = {o.verifier!r} is not a reward ({exc}); name a verifier "
                          "such as 'arith' or remove the key")
    return errors


def cme(sample: Sample) -> RewardResult:
    """Registered stand-in: a run builds the CME reward from `[reward]` (`from_config`); called directly, say so."""
    raise RuntimeError("reward 'cme' is built from its [reward.cme] settings (rollwise.rewards.build_reward_fn)")


cme.from_config = from_config  # type: ignore[attr-defined]
cme.config_errors = config_errors  # type: ignore[attr-defined]
cme.options = CMEOptions  # type: ignore[attr-defined]
