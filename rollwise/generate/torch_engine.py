"""In-process PyTorch rollout engine with continuous batching (CPU or one GPU).

- A fixed number of slots share a preallocated KV cache (`SlotCache`); when a sequence finishes, its slot
  takes the next waiting request, so no compute is spent on finished rows.
- Requests with the same context share one prefill: the prompt is encoded once and its KV copied to
  every slot that samples from it (the G samples of a GRPO group).
- Sampling runs on fp32 logits and returns the behaviour log-probability of each token (after top-k / top-p)
  and its untruncated log-probability (same temperature), which is what the trainer computes.
- A request can be aborted between tokens and continued later from its tokens (`response_ids`).
- A `feed` (rollwise.generate.feed) adds requests while `generate` runs: they take free slots of the running
  batch (the next turns of multi-turn episodes); the cache grows (slots, columns) when they need more room.

The engine keeps its own copy of the weights (possibly in another dtype than the trainer's), updated
through `update_weights`, as a remote engine would be.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from rollwise.generate import decode_attention
from rollwise.generate.quantize import fake_quantize_
from rollwise.generate.base import EngineCaps
from rollwise.generate.fused_decode import FusedDecoder
from rollwise.generate.sampling import sample_with_full_logprobs
from rollwise.generate.slot_cache import SlotCache
from rollwise.generate.speculative import Speculative
from rollwise.models.arch import FULL, SLIDING, describe, exact_attention, head_logits
from rollwise.models.compat import cache_kwargs
from rollwise.types import GenerationRequest, GenerationResult, SamplingParams, Status


@dataclass
class _Sequence:
    """A request being generated: its tokens so far and where it stands."""

    req: GenerationRequest
    ids: list[int]
    logprobs: list[float]
    start_len: int
    status: Status | None = None
    pending: int = -1  # sampled token not yet written to the cache
    full_logprobs: list[float] = field(default_factory=list)  # untruncated log-probs of `ids`


@dataclass
class EngineStats:
    """Counters since the last `reset`: tokens sampled, and tokens the model computed (incl. padding)."""

    generated_tokens: int = 0  # tokens sampled
    prefill_tokens: int = 0  # real context tokens prefilled (a context shared by several requests counts once)
    prefill_sequences: int = 0  # contexts prefilled (one LM-head row each)
    computed_tokens: int = 0  # token positions the model ran, padding and idle slots included
    decode_steps: int = 0
    active_slot_steps: int = 0  # real tokens fed to decode steps (one per active slot and step)

    def reset(self) -> None:
        self.__init__()

    @property
    def padding_eff(self) -> float:
        """Real tokens computed (prefilled context + tokens fed to decode steps) / tokens computed (with padding
        and idle slots); <= 1 by construction.

        Not `generated_tokens`: each sequence's last sampled token is never fed to the model, and the first
        token of every sample of a shared prefill comes from one context's logits (counting sampled tokens
        as computed once gave 1.27 for 8 samples x 4 tokens of one prompt)."""
        return (self.prefill_tokens + self.active_slot_steps) / max(1, self.computed_tokens)


class TorchEngine:
    """Engine protocol implementation around a Hugging Face causal LM.

    Args:
        model: the policy (copied; the engine owns its copy).
        tokenizer: used for EOS ids, stop strings and response text.
        dtype: dtype the engine computes in (float32 or bfloat16).
        max_batch_size: number of slots (sequences decoded together).
        seed: seed of the sampling generator (its state is saved with checkpoints).
        prefill_tokens: token budget of one prefill forward.
        fused: decode with `FusedDecoder` when the architecture supports it (else the model's own forward).
        weight_quant: "int8" or "fp8" weight-only rollouts (`rollwise.generate.quantize`; `rollout.engine_options`).
        draft_model: a model (local dir or name) sharing the tokenizer: speculative decoding with exact rejection
            sampling (`rollwise.generate.speculative`), `draft_tokens` proposals per round.
        gqa_attention: the model's forward (decode steps without the fused decoder, prefill, probes) attends with
            `rollwise.generate.decode_attention`: grouped K/V, never repeated per query head, and a prefill with no
            mask (causal SDPA). None: on where the engine is not on the CPU (the fused CPU decoder is faster there).
    """

    caps = EngineCaps(probe_logprobs=True, continue_aborted=True, rng_state=True, local_model=True, tensors=True,
                      request_feed=True)

    def __init__(self, model, tokenizer, dtype: torch.dtype = torch.float32, max_batch_size: int = 64,
                 seed: int = 0, prefill_tokens: int = 4096, fused: bool = True, weight_quant: str | None = None,
                 draft_model: str | None = None, draft_tokens: int = 4, gqa_attention: bool | None = None):
        self.model = copy.deepcopy(model).to(dtype).eval().requires_grad_(False)
        self.weight_quant = weight_quant  # int8 / fp8 weight-only rollouts (rollwise.generate.quantize), or None
        fake_quantize_(self.model, weight_quant)
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.prefill_tokens = prefill_tokens
        self.version = 0
        self.device = next(self.model.parameters()).device  # the model's: CPU, or a GPU in a generation process
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.stats = EngineStats()
        self._aborted: set[int] = set()
        self._lock = threading.Lock()
        if self.model.config._attn_implementation not in ("sdpa", "eager"):  # e.g. the trainer's block attention:
            self.model.set_attn_implementation("sdpa")  # decode steps hand the model plain 4-D masks
        exact_attention(self.model)
        # the geometry the model really uses (a config may carry keys its architecture ignores)
        self.arch = describe(self.model)
        self._layers, self._kv_heads, self._head_dim = self.arch.layers, self.arch.kv_heads, self.arch.key_dim
        eligible = fused and FusedDecoder.refusal(self.model, self.arch) is None
        self.fused = FusedDecoder(self.model, max_batch_size) if eligible else None
        want_gqa = self.device.type != "cpu" if gqa_attention is None else gqa_attention
        self.gqa_attention = bool(want_gqa) and decode_attention.use(self.model)  # False where it refuses the model
        self.speculative = None if draft_model is None else Speculative(self, draft_model, draft_tokens)
        if self.speculative is not None:
            self.caps = dataclasses.replace(self.caps, request_feed=False)

    # -- protocol -----------------------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        own = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor)
        fake_quantize_(self.model, self.weight_quant)
        if self.fused is not None:
            self.fused.refresh()
        self.version = version

    def abort(self, request_ids: list[int]) -> None:
        with self._lock:
            self._aborted.update(request_ids)

    def generate(self, requests: list[GenerationRequest], on_finish=None, feed=None) -> list[GenerationResult]:
        """Run every request to completion (or abort) in one continuous batch; requests may carry different
        sampling params (each params value draws from its own generator when seeded).

        `on_finish(result)` is called as each request finishes, between decode steps; it may call `abort`
        (partial rollouts stop the rest of the batch that way). A request aborted before it was admitted
        returns at once with the tokens it came with. `feed` (a `rollwise.generate.feed.Feed`) is asked for
        more requests before every decode step; the call returns once it is done and every request finished
        (results of fed requests reach `on_finish` only).
        """
        results = _Results(on_finish)
        if self.speculative is not None:
            self.speculative.run(requests, results, feed)
        elif requests or feed is not None:
            self._run(requests, results, feed)
        with self._lock:
            self._aborted.difference_update(results)
        return [results[r.request_id] for r in requests]

    # -- the decode loop ----------------------------------------------------------------------------
    @torch.inference_mode()
    def _run(self, reqs: list[GenerationRequest], results: dict, feed=None) -> None:
        generators: dict[SamplingParams, torch.Generator] = {}
        self._add_generators(reqs, generators)
        cache = SlotCache(self._layers, max(1, min(self.max_batch_size, len(reqs))), self._kv_heads,
                          _room(reqs), self._head_dim, self.dtype, self.device, value_dim=self.arch.value_dim)
        waiting = deque(reqs)
        slots: list[_Sequence | None] = [None] * cache.slots
        while True:
            if feed is not None and not feed.done:
                fed = feed.take(idle=not waiting and not any(slots))
                if fed:
                    self._add_generators(fed, generators)
                    waiting.extend(fed)
                    slots = self._make_room(cache, slots, fed, len(waiting))
            if not waiting and not any(slots):
                if feed is None or feed.done:
                    return
                continue
            free = [i for i, s in enumerate(slots) if s is None]
            if free and waiting:
                admitted = [_Sequence(waiting.popleft(), [], [], 0) for _ in range(min(len(free), len(waiting)))]
                self._admit(cache, slots, free, admitted, generators, results)
            active = [i for i, s in enumerate(slots) if s is not None]
            if not active:
                continue
            tail = not waiting and (feed is None or feed.done)  # nothing more will come to fill empty slots
            if tail and len(active) <= cache.slots // 2:  # long tail: stop computing empty slots
                cache.keep(torch.tensor(active, device=self.device))
                slots = [slots[i] for i in active]
                active = list(range(len(slots)))
            self._decode_step(cache, slots, active, generators, results)

    def _add_generators(self, reqs: list[GenerationRequest], generators: dict) -> None:
        """The sampling generator of each new params value: its own when seeded, else the engine's stream."""
        for r in reqs:
            if r.params not in generators:
                seeded = r.params.seed is not None
                generators[r.params] = (torch.Generator(device=self.device).manual_seed(r.params.seed) if seeded
                                        else self.generator)

    def _make_room(self, cache: SlotCache, slots: list, fed: list[GenerationRequest], waiting: int) -> list:
        """Fed requests may need longer rows or more slots than the call started with: grow the cache (up to
        `max_batch_size` slots; columns by at least a quarter, so growth is rare). Returns the slot list."""
        busy = sum(s is not None for s in slots)
        want_slots = max(cache.slots, min(self.max_batch_size, busy + waiting))
        need = _room(fed)
        want_columns = cache.capacity if need <= cache.capacity else max(need, cache.capacity * 5 // 4)
        if want_slots > cache.slots or want_columns > cache.capacity:
            grow_cache(cache, want_slots, want_columns)
        return slots + [None] * (cache.slots - len(slots))

    def _admit(self, cache, slots, free, admitted, generators, results) -> None:
        """Prefill the admitted requests (one forward per distinct context), sample their first token."""
        for seq in admitted:
            seq.ids, seq.logprobs = list(seq.req.response_ids), list(seq.req.response_logprobs)
            seq.full_logprobs = list(seq.req.response_full_logprobs or seq.req.response_logprobs)
            seq.start_len = len(seq.ids)
            if seq.start_len >= seq.req.params.max_new_tokens:
                seq.status = Status.TRUNCATED
            elif seq.req.request_id in self._aborted:
                seq.status = Status.ABORTED
        todo = [s for s in admitted if s.status is None]
        for s in admitted:
            if s.status is not None:
                results[s.req.request_id] = self._result(s)
        if not todo:
            return
        contexts = [tuple(s.req.prompt_ids + s.req.response_ids) for s in todo]
        unique = list(dict.fromkeys(contexts))
        row_of = {c: i for i, c in enumerate(unique)}
        logits, layer_kv, lengths = self._prefill([list(c) for c in unique])  # [U, V]
        rows = torch.tensor([row_of[c] for c in contexts], dtype=torch.long, device=self.device)  # [A]
        slot_ids = torch.tensor(free[: len(todo)], dtype=torch.long, device=self.device)
        cache.load_prefill(slot_ids, layer_kv, rows, lengths[rows])
        tokens, logprobs, full = _sample_rows(logits[rows], [s.req.params for s in todo], generators)
        for seq, slot, tok, lp, full_lp in zip(todo, slot_ids.tolist(), tokens, logprobs, full):
            slots[slot] = seq
            self._append(seq, tok, lp, full_lp)
            if seq.status is not None:
                results[seq.req.request_id] = self._result(seq)
                slots[slot] = None
                cache.lengths[slot] = 0

    def _prefill(self, contexts: list[list[int]]):
        """Right-padded forward over distinct contexts, in chunks of `prefill_tokens`.

        Returns (last-token logits [U, V] fp32, per-layer (keys, values) [U, kv_heads, L, head_dim], lengths [U]).
        """
        width = max(len(c) for c in contexts)
        per_chunk = max(1, self.prefill_tokens // width)
        logits, keys, values = [], [[] for _ in range(self._layers)], [[] for _ in range(self._layers)]
        for start in range(0, len(contexts), per_chunk):
            chunk = contexts[start : start + per_chunk]
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long, device="cpu")  # moved once below
            attn = torch.zeros((len(chunk), width), dtype=torch.long, device="cpu")
            for row, c in enumerate(chunk):
                ids[row, : len(c)] = torch.tensor(c, device="cpu")
                attn[row, : len(c)] = 1
            real = int(attn.sum())  # counted on the host, before the move
            ids, attn = ids.to(self.device), attn.to(self.device)
            if self.fused is not None:
                chunk_logits, chunk_kv = self.fused.prefill(ids, attn.sum(-1))
            else:
                chunk_logits, chunk_kv = self._model_prefill(ids, attn)
            logits.append(chunk_logits.float())
            for layer, (k, v) in enumerate(chunk_kv):
                keys[layer].append(k)
                values[layer].append(v)
            self.stats.computed_tokens += ids.numel()
            self.stats.prefill_tokens += real
            self.stats.prefill_sequences += len(chunk)
        layer_kv = [(torch.cat(keys[i]), torch.cat(values[i])) for i in range(self._layers)]
        lengths = torch.tensor([len(c) for c in contexts], dtype=torch.long, device=self.device)
        return torch.cat(logits), layer_kv, lengths

    def _model_prefill(self, ids: torch.Tensor, attn: torch.Tensor):
        """Prefill with the model's own forward: (last-token logits [u, V], per-layer (keys, values)). With
        `gqa_attention` no mask is passed: rows are right-padded, so under the causal mask no real token sees a pad
        (the pads' own keys, past each row's length, are masked in decode steps), and SDPA runs causal, unmasked."""
        dyn = DynamicCache()
        width = ids.shape[1]
        decoder = self.model.get_decoder()
        mask = None if self.gqa_attention else attn
        hidden = decoder(input_ids=ids, attention_mask=mask, **cache_kwargs(decoder, dyn), use_cache=True,
                                          position_ids=torch.arange(width, device=ids.device).expand(len(ids), -1)
                                          ).last_hidden_state
        last = hidden[torch.arange(len(ids), device=ids.device), attn.sum(-1) - 1]  # [u, H]
        kv = [(dyn.layers[i].keys, dyn.layers[i].values) for i in range(self._layers)]
        return head_logits(self.arch, self.model, last), kv

    def _decode_step(self, cache, slots, active, generators, results) -> None:
        """One token for every active slot: one host-to-device copy (pending tokens, active flags, active slot
        ids) and one device-to-host copy (`_sample_rows`) per step."""
        pending, flags = [self.pad_id] * cache.slots, [0] * cache.slots
        for i in active:
            pending[i], flags[i] = slots[i].pending, 1
        host = torch.tensor(pending + flags + active, dtype=torch.long, device="cpu")  # [pending | flags | active]
        packed = host.to(self.device)
        pending, is_active, idx = packed[: cache.slots], packed[cache.slots : 2 * cache.slots] > 0, \
            packed[2 * cache.slots :]
        positions, mask = cache.begin_step()
        if self.fused is not None:
            logits = self.fused.step(pending, positions[:, 0], cache, idx)  # [A, V]
        else:
            out = self.model(input_ids=pending[:, None], attention_mask=self._decode_mask(cache, mask),
                             position_ids=positions,
                             **cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=1)
            logits = out.logits[idx, -1]
        cache.end_step(is_active)
        # the fused step runs its projections and MLP on active rows only (attention still spans every slot)
        self.stats.computed_tokens += len(active) if self.fused is not None else cache.slots
        self.stats.decode_steps += 1
        self.stats.active_slot_steps += len(active)
        tokens, logprobs, full = _sample_rows(logits, [slots[i].req.params for i in active], generators)
        for i, tok, lp, full_lp in zip(active, tokens, logprobs, full):
            seq = slots[i]
            self._append(seq, tok, lp, full_lp)
            if seq.status is not None:
                results[seq.req.request_id] = self._result(seq)
                slots[i] = None
                cache.lengths[i] = 0

    def _decode_mask(self, cache, causal: torch.Tensor):
        """The attention mask the model's forward takes for a decode step: `causal` [slots, 1, 1, W] bool, the
        window's mask for sliding-window layers (one per layer type when only some layers slide), additive
        (0 / dtype min) for eager attention, which adds its mask to the scores."""
        windows = {w for w in self.arch.windows if w is not None}
        masks = {FULL: causal, **{SLIDING: cache.window_mask(w) for w in windows}}
        if self.model.config._attn_implementation == "eager":
            low = torch.finfo(self.dtype).min
            masks = {k: torch.zeros(m.shape, dtype=self.dtype, device=m.device).masked_fill_(~m, low)
                     for k, m in masks.items()}
        if self.arch.mask_keys:
            return {key: masks[key] for key in self.arch.mask_keys}
        return masks[SLIDING] if windows else masks[FULL]

    def _append(self, seq: _Sequence, token: int, logprob: float, full_logprob: float) -> None:
        """Record a sampled token (behaviour and untruncated log-probs) and decide whether the sequence stops here."""
        seq.ids.append(token)
        seq.logprobs.append(logprob)
        seq.full_logprobs.append(full_logprob)
        seq.pending = token
        self.stats.generated_tokens += 1
        params = seq.req.params
        if token in self.eos_ids:
            seq.status = Status.COMPLETED
        elif params.stop and self._hit_stop(seq.ids, params):
            seq.status = Status.COMPLETED
        elif len(seq.ids) >= params.max_new_tokens:
            seq.status = Status.TRUNCATED
        elif seq.req.request_id in self._aborted:
            seq.status = Status.ABORTED

    def _hit_stop(self, ids: list[int], params: SamplingParams) -> bool:
        longest = max(len(s) for s in params.stop)
        tail = self.tokenizer.decode(ids[-(longest + 8) :], skip_special_tokens=False)
        return any(s in tail for s in params.stop)

    def _result(self, seq: _Sequence) -> GenerationResult:
        return sequence_result(seq, self.version, self.tokenizer)

    @torch.inference_mode()
    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs at temperature 1 of token_ids[1:] given the preceding tokens (length len - 1), computed by
        the engine's current weights in fp32 log-softmax (the Sync stage compares them with the trainer's)."""
        if len(token_ids) < 2:
            return []
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, L]
        logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()  # [L-1, V]
        targets = ids[0, 1:, None]
        return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1).tolist()

    def pop_metrics(self) -> dict[str, float]:
        """Engine metrics since the last call (`rollout/spec_accept_rate` with a draft model)."""
        return self.speculative.stats.pop() if self.speculative is not None else {}

    def rng_state(self) -> torch.Tensor:
        """The state of the sampling generator of unseeded requests (saved with checkpoints)."""
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def close(self) -> None:
        """Nothing to release beyond the Python objects (no processes); idempotent."""
        self._aborted.clear()


def _room(reqs: list[GenerationRequest]) -> int:
    """Cache columns the requests need: context plus new tokens, plus the one column a step writes ahead."""
    return max((len(r.prompt_ids) + max(len(r.response_ids), r.params.max_new_tokens) for r in reqs), default=0) + 1


def grow_cache(cache: SlotCache, slots: int, capacity: int) -> None:
    """Grow `cache` in place to `slots` slots of `capacity` columns; new slots and columns are zero (masked
    out until written), what is cached keeps its place."""
    more_slots, more_columns = slots - cache.slots, capacity - cache.capacity
    pad = torch.nn.functional.pad
    cache.keys = [pad(k, (0, more_columns, 0, 0, 0, 0, 0, more_slots)) for k in cache.keys]  # [S, kv, D, C]
    cache.values = [pad(v, (0, 0, 0, more_columns, 0, 0, 0, more_slots)) for v in cache.values]  # [S, kv, C, Dv]
    cache.lengths = torch.cat([cache.lengths, cache.lengths.new_zeros(more_slots)])


class _Results(dict):
    """request id -> result, calling `on_finish(result)` as each one is stored."""

    def __init__(self, on_finish=None):
        super().__init__()
        self.on_finish = on_finish

    def __setitem__(self, request_id: int, result: GenerationResult) -> None:
        super().__setitem__(request_id, result)
        if self.on_finish is not None:
            self.on_finish(result)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: dict) -> tuple[list, list, list]:
    """Sample one token per row of logits [A, V], each row under its request's params (rows with equal
    params are sampled together, in row order). Returns (tokens, behaviour logprobs, untruncated logprobs)
    as lists of length A, read back from the device in one copy for all params groups (float64 holds a token id
    and an fp32 log-prob exactly)."""
    by_params: dict[SamplingParams, list[int]] = {}
    for row, p in enumerate(params):
        by_params.setdefault(p, []).append(row)
    packed = torch.empty((3, len(params)), dtype=torch.float64, device=logits.device)  # [tokens | lp | full], A
    for p, rows in by_params.items():
        index = None if len(rows) == len(params) else torch.tensor(rows, device=logits.device)  # [a]
        picked = logits if index is None else logits[index]  # [a, V]
        tok, lp, full = sample_with_full_logprobs(picked.float(), p.temperature, p.top_k, p.top_p, generators[p])
        columns = torch.stack([tok.double(), lp.double(), full.double()])  # [3, a]
        if index is None:
            packed = columns
        else:
            packed[:, index] = columns
    tokens, logprobs, full_logprobs = packed.cpu()  # the one device-to-host copy
    return tokens.long().tolist(), logprobs.tolist(), full_logprobs.tolist()


def sequence_result(seq, version: int, tokenizer) -> GenerationResult:
    """The result of a finished (or aborted) sequence: its tokens, log-probs and status, the span of the tokens
    this call added tagged with `version` (the caller keeps earlier spans), and its text cut at a stop string.
    `seq` has `req`, `ids`, `logprobs`, `full_logprobs`, `start_len` and `status` (any engine's sequence)."""
    spans = [(seq.start_len, len(seq.ids), version)] if len(seq.ids) > seq.start_len else []
    text = tokenizer.decode(seq.ids, skip_special_tokens=True)
    if seq.status == Status.COMPLETED and seq.req.params.stop:
        text = _cut_at_stop(text, seq.req.params.stop)
    return GenerationResult(seq.req.request_id, seq.ids, seq.logprobs, seq.status, spans, text,
                            full_logprobs=seq.full_logprobs or [])


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
