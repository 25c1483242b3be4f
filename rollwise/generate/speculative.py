"""Draft-model speculative decoding for the torch engine, with exact rejection sampling.

Papers: Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al.
2023, "Accelerating Large Language Model Decoding with Speculative Sampling"; used for RL rollouts in Bebop
(seed issue 23). A small draft model proposes `k` tokens one at a time (distributions q); the target scores the
whole proposal in one forward (distributions p at k+1 positions); token i is accepted with probability
min(1, p(x_i) / q(x_i)); at the first rejection a token is drawn from norm(max(0, p - q)); when all k are
accepted, one more token is drawn from p at position k+1. Every emitted token is then distributed exactly as
the target's sampling distribution (the proof is Leviathan et al.'s Appendix A.1), so rollouts stay on-policy.

Choices the papers leave open, and why:
- p and q are both the *sampling* distributions: temperature, then the same top-k / top-p applied to each
  model's own logits (`rollwise.generate.sampling.filter_logits`). Acceptance against the target's truncated
  distribution is what makes the output exactly the target's truncated sampler.
- The behaviour log-probs reported are the target's: `log p(x)` (truncated, what the engine samples from) and
  the untruncated tempered log-prob (what the trainer computes), as the plain engine reports; the draft's
  distribution never reaches the trainer.
- Greedy (`temperature == 0`): a draft token is accepted when it is the target's argmax, which keeps the output
  identical to plain greedy decoding.
- Requests run one at a time with per-model KV caches (`DynamicCache`, cropped back after a rejection). The
  plain engine's continuous batching is not combined with speculation here: speculation pays off where decode
  is memory-bound at small batch, and a ragged accept length per row would need per-row cache rewinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from rollwise.generate.sampling import filter_logits
from rollwise.types import Status


@dataclass
class Verdict:
    """One speculation round: the tokens to emit (accepted drafts, then one token from the target) and how many
    of the proposed drafts were accepted."""

    tokens: list[int]
    accepted: int


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution sampled from: logits [N, V] -> probs [N, V] fp32 after temperature and top-k / top-p.
    Greedy (temperature 0) is a one-hot on the argmax."""
    logits = logits.float()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)


def verify(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """Rejection-sample the proposal against the target.

    draft_tokens: k proposed ids; q: [k, V] draft sampling probs the proposals were drawn from; p: [k+1, V]
    target sampling probs (row i is the distribution of the token after the context plus drafts[:i]).
    Returns the emitted tokens (length accepted + 1), distributed exactly as sequential sampling from p.
    """
    k = len(draft_tokens)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float32, device=p.device)  # [k]
    for i, token in enumerate(draft_tokens):
        p_x, q_x = float(p[i, token]), float(q[i, token])
        if q_x > 0 and float(uniforms[i]) * q_x < p_x:  # accept with probability min(1, p/q)
            continue
        residual = (p[i] - q[i]).clamp_(min=0.0)  # [V]
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: the residual is empty, p itself is exact
            residual = p[i]
        extra = int(torch.multinomial(residual, 1, generator=generator))
        return Verdict(list(draft_tokens[:i]) + [extra], i)
    extra = int(torch.multinomial(p[k], 1, generator=generator))
    return Verdict(list(draft_tokens) + [extra], k)


class CachedModel:
    """A causal LM over one growing sequence, with a KV cache that can be cut back (batch size 1)."""

    def __init__(self, model):
        self.model = model
        self.cache = DynamicCache()
        self.length = 0  # tokens in the cache

    def feed(self, sequence: list[int]) -> torch.Tensor:
        """Run the tokens of `sequence` not yet cached; returns their logits [n, V] fp32 (n >= 1)."""
        if self.length >= len(sequence):  # re-run the last token to get its logits again
            self.crop(len(sequence) - 1)
        device = next(self.model.parameters()).device
        ids = torch.tensor([sequence[self.length:]], dtype=torch.long, device=device)  # [1, n]
        positions = torch.arange(self.length, len(sequence), device=device)[None]  # [1, n]
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, position_ids=positions)
        self.length = len(sequence)
        return out.logits[0].float()

    def crop(self, length: int) -> None:
        """Keep the first `length` cached tokens."""
        if length < self.length:
            self.cache.crop(length - self.length)  # a negative count: drop that many trailing tokens
            self.length = length


def speculate_round(target: CachedModel, draft: CachedModel, sequence: list[int], k: int, params,
                    generator: torch.Generator | None) -> tuple[Verdict, torch.Tensor]:
    """Propose k tokens with the draft, verify them with one target forward.

    sequence: context so far (prompt + response); k >= 1. Returns the verdict and the target's raw logits
    [k+1, V] (for the reported log-probs). Both caches are left holding the context plus what was emitted,
    minus its last token (which the next round feeds)."""
    temperature, top_k, top_p = params.temperature, params.top_k, params.top_p
    drafts: list[int] = []
    q_rows = []
    for _ in range(k):
        logits = draft.feed(sequence + drafts)[-1:]  # [1, V]
        q = sampling_probs(logits, temperature, top_k, top_p)[0]
        drafts.append(int(torch.multinomial(q, 1, generator=generator)) if temperature > 0 else int(q.argmax()))
        q_rows.append(q)
    # the target runs the uncached tail of the context and every draft: its last k+1 rows score the proposal
    target_logits = target.feed(sequence + drafts)[-(k + 1):]  # [k+1, V]
    p = sampling_probs(target_logits, temperature, top_k, top_p)
    verdict = verify(drafts, torch.stack(q_rows), p, generator)
    kept = len(sequence) + len(verdict.tokens) - 1
    target.crop(kept)
    draft.crop(kept)
    return verdict, target_logits[: len(verdict.tokens)]


def token_logprobs(logits: torch.Tensor, tokens: list[int], params) -> tuple[list[float], list[float]]:
    """Target log-probs of the emitted tokens: (behaviour = under the truncated sampling distribution,
    untruncated = tempered softmax), logits [n, V], n = len(tokens); greedy reports the untempered softmax."""
    index = torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None]
    if params.temperature == 0.0:
        full = torch.log_softmax(logits, -1).gather(-1, index).squeeze(-1)
        return full.tolist(), full.tolist()
    scaled = logits / params.temperature
    behaviour = torch.log_softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p), -1)
    full = torch.log_softmax(scaled, -1)
    return behaviour.gather(-1, index).squeeze(-1).tolist(), full.gather(-1, index).squeeze(-1).tolist()


@dataclass
class SpecSequence:
    """A request being decoded speculatively (the fields the torch engine's `_append` and `sequence_result` use)."""

    req: object  # GenerationRequest
    ids: list[int]
    logprobs: list[float]
    start_len: int
    status: Status | None = None
    pending: int = -1
    full_logprobs: list[float] = field(default_factory=list)


@dataclass
class SpecStats:
    """Draft tokens proposed and accepted since the last `pop`."""

    proposed: int = 0
    accepted: int = 0

    def pop(self) -> dict[str, float]:
        """`rollout/spec_accept_rate` (accepted / proposed drafts) and `rollout/spec_proposed`; {} when idle."""
        if not self.proposed:
            return {}
        out = {"rollout/spec_accept_rate": self.accepted / self.proposed, "rollout/spec_proposed": float(self.proposed)}
        self.proposed = self.accepted = 0
        return out


def generate_one(engine, seq, draft_model, k: int, generator, stats: SpecStats) -> None:
    """Decode `seq` (a torch engine `_Sequence`, already admitted) to its end with speculation, appending each
    token through `engine._append` (which sets its status on EOS, a stop string, the token limit or abort)."""
    params = seq.req.params
    target, draft = CachedModel(engine.model), CachedModel(draft_model)
    prefix = list(seq.req.prompt_ids)
    while seq.status is None:
        sequence = prefix + seq.ids
        room = params.max_new_tokens - len(seq.ids)
        k_now = min(k, room - 1)
        if k_now < 1:  # one token left: a plain target step
            logits = target.feed(sequence)[-1:]
            p = sampling_probs(logits, params.temperature, params.top_k, params.top_p)[0]
            tokens = [int(torch.multinomial(p, 1, generator=generator)) if params.temperature > 0 else int(p.argmax())]
        else:
            verdict, logits = speculate_round(target, draft, sequence, k_now, params, generator)
            tokens = verdict.tokens
            stats.proposed += k_now
            stats.accepted += verdict.accepted
        behaviour, full = token_logprobs(logits[-len(tokens):], tokens, params)
        engine.stats.decode_steps += 1
        engine.stats.computed_tokens += 1 if k_now < 1 else k_now + 1  # target positions run this round
        engine.stats.active_slot_steps += len(tokens)
        for token, lp, full_lp in zip(tokens, behaviour, full):
            engine._append(seq, token, lp, full_lp)
            if seq.status is not None:
                break


class Speculative:
    """The torch engine's speculative mode: the frozen draft model and the per-request decode loop.

    engine: the `TorchEngine` (its model is the target; its `_append`, `_add_generators`, `_result` and stats
    are reused); draft_model: a model name or local dir sharing the target's tokenizer; draft_tokens: k >= 1."""

    def __init__(self, engine, draft_model: str, draft_tokens: int):
        from rollwise.models.resolve import load_model

        if int(draft_tokens) < 1:
            raise ValueError(f"rollout.engine_options.draft_tokens = {draft_tokens!r}: use an integer >= 1")
        model, _ = load_model(draft_model, engine.dtype)
        target_vocab = engine.model.get_output_embeddings().weight.shape[0]
        draft_vocab = model.get_output_embeddings().weight.shape[0]
        if draft_vocab != target_vocab:
            raise ValueError(f"rollout.engine_options.draft_model = {draft_model!r} has {draft_vocab} output tokens "
                             f"and the policy {target_vocab}: use a draft model with the policy's tokenizer")
        self.draft = model.to(engine.device).eval().requires_grad_(False)
        self.engine, self.k, self.stats = engine, int(draft_tokens), SpecStats()

    @torch.inference_mode()
    def run(self, requests, results, feed=None) -> None:
        """Decode every request (then every fed one) to its end, one at a time; results go to `results`."""
        engine, generators = self.engine, {}
        waiting = list(requests)
        while waiting or (feed is not None and not feed.done):
            if not waiting:
                waiting = list(feed.take(idle=True))
                continue
            req = waiting.pop(0)
            engine._add_generators([req], generators)
            seq = SpecSequence(req, list(req.response_ids), list(req.response_logprobs), len(req.response_ids))
            seq.full_logprobs = list(req.response_full_logprobs or req.response_logprobs)
            if seq.start_len >= req.params.max_new_tokens:
                seq.status = Status.TRUNCATED
            elif req.request_id in engine._aborted:
                seq.status = Status.ABORTED
            else:
                engine.stats.prefill_tokens += len(req.prompt_ids) + seq.start_len
                engine.stats.prefill_sequences += 1
                engine.stats.computed_tokens += len(req.prompt_ids) + seq.start_len - 1
                generate_one(engine, seq, self.draft, self.k, generators[req.params], self.stats)
            results[req.request_id] = engine._result(seq)

