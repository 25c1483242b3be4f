"""In-process PyTorch rollout engine: batched sampling with a KV cache (CPU or one GPU).

The engine keeps its own copy of the weights (so the trainer can run in another precision and
weights are synchronised explicitly, as with any remote engine). Finished rows leave the batch, so
no compute is spent on them after they stop.
"""

from __future__ import annotations

import copy
import threading

import torch
from transformers import DynamicCache

from rollwise.generate.sampling import sample_tokens
from rollwise.types import GenerationRequest, GenerationResult, SamplingParams, Status


class TorchEngine:
    """Engine protocol implementation around a Hugging Face causal LM.

    Args:
        model: the policy (copied; the engine owns its copy).
        tokenizer: used for EOS ids, stop strings and response text.
        dtype: dtype the engine computes in (float32 or bfloat16).
        max_batch_size: sequences decoded together.
        seed: seed of the sampling generator (its state is saved with checkpoints).
    """

    def __init__(self, model, tokenizer, dtype: torch.dtype = torch.float32, max_batch_size: int = 64, seed: int = 0):
        self.model = copy.deepcopy(model).to(dtype).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.version = 0
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self._aborted: set[int] = set()
        self._lock = threading.Lock()
        self.stats = {"tokens": 0, "computed_tokens": 0, "forward_calls": 0}

    # -- protocol -----------------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        own = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor)
        self.version = version

    def abort(self, request_ids: list[int]) -> None:
        with self._lock:
            self._aborted.update(request_ids)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results: dict[int, GenerationResult] = {}
        # similar lengths together keeps left padding small
        order = sorted(requests, key=lambda r: len(r.prompt_ids) + len(r.response_ids))
        for start in range(0, len(order), self.max_batch_size):
            for res in self._generate_batch(order[start : start + self.max_batch_size]):
                results[res.request_id] = res
        with self._lock:
            self._aborted.difference_update(results)
        return [results[r.request_id] for r in requests]

    # -- internals ----------------------------------------------------------------------------
    @torch.inference_mode()
    def _generate_batch(self, batch: list[GenerationRequest]) -> list[GenerationResult]:
        params = batch[0].params
        if any(r.params != params for r in batch):
            return [res for r in batch for res in self._generate_batch([r])]
        generator = self.generator if params.seed is None else torch.Generator().manual_seed(params.seed)
        contexts = [tuple(r.prompt_ids + r.response_ids) for r in batch]
        unique = list(dict.fromkeys(contexts))  # samples of one prompt share its prefill
        input_ids, attn = _left_pad([list(c) for c in unique], self.pad_id)  # [U, L]
        positions = (attn.cumsum(-1) - 1).clamp(min=0)  # [U, L]
        cache = DynamicCache()
        logits = self._forward(input_ids, attn, positions, cache)  # [U, V]
        self.stats["computed_tokens"] += input_ids.numel()
        if len(unique) < len(batch):  # copy each prompt's KV cache to its samples' rows
            row_of = {c: i for i, c in enumerate(unique)}
            expand = torch.tensor([row_of[c] for c in contexts])  # [B]
            cache.batch_select_indices(expand)
            logits, attn, positions = logits[expand], attn[expand], positions[expand]

        out_ids = [list(r.response_ids) for r in batch]
        out_lp = [list(r.response_logprobs) for r in batch]
        start_len = [len(r.response_ids) for r in batch]
        status: list[Status | None] = [None] * len(batch)
        active = torch.arange(len(batch))  # rows of `batch` still in the cache, in cache order
        next_pos = positions[:, -1] + 1  # [B]
        budget = [params.max_new_tokens - len(r.response_ids) for r in batch]
        for i, b in enumerate(budget):
            if b <= 0:
                status[i] = Status.TRUNCATED
        while True:
            live = [i for i in active.tolist() if status[i] is None]
            if not live:
                break
            keep = torch.tensor([status[i] is None for i in active.tolist()])
            if not bool(keep.all()):
                idx = keep.nonzero().squeeze(-1)
                cache.batch_select_indices(idx)
                logits, attn, next_pos, active = logits[idx], attn[idx], next_pos[idx], active[idx]
            tokens, logprobs = sample_tokens(logits, params.temperature, params.top_k, params.top_p, generator)
            for row, i in enumerate(active.tolist()):
                self._append(i, int(tokens[row]), float(logprobs[row]), out_ids, out_lp, status, batch, start_len)
            if all(status[i] is not None for i in active.tolist()):
                break
            attn = torch.cat([attn, torch.ones(len(active), 1, dtype=attn.dtype)], dim=-1)
            logits = self._forward(tokens[:, None], attn, next_pos[:, None], cache)
            self.stats["computed_tokens"] += len(active)
            next_pos = next_pos + 1
        return [self._result(r, out_ids[i], out_lp[i], status[i], start_len[i]) for i, r in enumerate(batch)]

    def _forward(self, input_ids, attn, positions, cache) -> torch.Tensor:
        self.stats["forward_calls"] += 1
        out = self.model(
            input_ids=input_ids, attention_mask=attn, position_ids=positions,
            cache=cache, use_cache=True, logits_to_keep=1,
        )
        return out.logits[:, -1, :].float()  # [B, V]

    def _append(self, i, token, logprob, out_ids, out_lp, status, batch, start_len) -> None:
        req = batch[i]
        out_ids[i].append(token)
        out_lp[i].append(logprob)
        self.stats["tokens"] += 1
        if token in self.eos_ids:
            status[i] = Status.COMPLETED
        elif req.params.stop and self._hit_stop(out_ids[i], req.params):
            status[i] = Status.COMPLETED
        elif len(out_ids[i]) >= req.params.max_new_tokens:
            status[i] = Status.TRUNCATED
        elif req.request_id in self._aborted:
            status[i] = Status.ABORTED

    def _hit_stop(self, ids: list[int], params: SamplingParams) -> bool:
        longest = max(len(s) for s in params.stop)
        tail = self.tokenizer.decode(ids[-(longest + 8) :], skip_special_tokens=False)
        return any(s in tail for s in params.stop)

    def _result(self, req, ids, lps, status, start_len) -> GenerationResult:
        # spans of this call only; the caller keeps the spans of tokens generated earlier
        spans = [(start_len, len(ids), self.version)] if len(ids) > start_len else []
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if status == Status.COMPLETED and req.params.stop:
            text = _cut_at_stop(text, req.params.stop)
        return GenerationResult(req.request_id, ids, lps, status, spans, text)


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists. Returns (ids [B, L] long, attention mask [B, L] long)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[row, width - len(s) :] = 1
    return ids, mask


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _cut_at_stop(text: str, stops) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text[:cut] if cut >= 0 else text
