"""The vLLM rollout engine (`vllm.LLM` built in this process) behind rollwise's engine protocol.

- Token ids in and out: prompts go in as `TokensPrompt` (never re-tokenised text), responses come back as
  the sampled ids; `text` is decoded by rollwise's tokenizer, as the torch engine does.
- Behaviour log-probs: `SamplingParams(logprobs=0)` returns the sampled token's log-prob; the engine runs with
  `logprobs_mode="processed_logprobs"`, which vLLM 0.32 computes after temperature *and* top-k / top-p
  (`v1/sample/ops/topk_topp_sampler.py`: `apply_top_k_top_p` then `log_softmax`), i.e. under the
  distribution actually sampled. Greedy rows get the untempered log-softmax (as the torch engine's).
  vLLM does not return the untruncated log-prob at the same temperature, so `full_logprobs` is filled only
  when nothing is truncated (then it equals `logprobs`) and left empty otherwise.
- The decode loop is driven here (`llm_engine.add_request` / `step` / `abort_request`, outputs as deltas), so
  `on_finish` can abort the other requests between steps (partial rollouts); aborted results keep their
  tokens and are continued by a request whose `response_ids` holds them.
- Where the engine core runs: in a child process (vLLM's default), or with `options["in_process"]` in this
  one (`rollwise.generate.vllm_inprocess`: the trade-off is written there). A training run's engine starts
  in process (`rollwise.generate.factory.engine_options`), unless the trainer is FSDP2.
- Weights: `update_weights(state_dict, version)` hands an engine core running here the tensors (the model's
  `load_weights` through vLLM's in-place reload, cast to the engine's dtype, no file: the `tensors` transport),
  and one in a child a safetensors folder it reloads (`reload_from`, the `safetensors` transport). Both go
  through the worker extension (`rollwise.generate.vllm_ext`), which re-packs a tied head; the prefix cache is
  reset after. A partial state dict is refused before anything loads; a load that fails half-way leaves
  `version = None` and `generate` refuses until a sync succeeds.
  LoRA: `update_adapter(dir, version)` makes later calls use `LoRARequest(f"v{version}", new id, dir)`.
- Memory: on CUDA the KV cache is sized by `gpu_memory_utilization` (a colocated engine gets
  `COLOCATED_GPU_SHARE` of the GPU from the factory); with `enable_sleep_mode` (the factory's default for an
  engine sharing the trainer's GPU) `release_memory()` puts vLLM to sleep (level 1) for the Train stage, and
  the next sync or generation wakes what it needs. Neither has run on a GPU yet (docs/gpu.md).

vLLM on CPU: pass a small KV cache (the default here is 256 MiB, `options["kv_cache_memory_bytes"]`
overrides) and set `OMP_NUM_THREADS` (a spawned engine core reads it; this module sets it to torch's thread
count when unset). Scripts that build an engine need `if __name__ == "__main__":`.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from rollwise.generate import vllm_inprocess
from rollwise.generate.base import EngineCaps
from rollwise.generate.torch_engine import EngineStats, _cut_at_stop, _eos_ids
from rollwise.generate.vllm_options import DTYPE_NAMES as _DTYPES, llm_kwargs
from rollwise.types import GenerationRequest, GenerationResult, SamplingParams, Status

_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
# per-request seeds of requests sharing one seeded params value: seed + k * this (see `_request_seed`)
_SEED_STRIDE = 1_000_003


class EngineStateError(RuntimeError):
    """The engine's weights are not a known policy version (a sync failed half-way)."""


@dataclass
class _Live:
    """A request in flight: everything generated so far (earlier calls' tokens included)."""

    req: GenerationRequest
    ids: list[int]
    logprobs: list[float]
    full_logprobs: list[float] | None  # None: this request truncates (top-k / top-p), no untruncated values
    start_len: int
    status: Status | None = None


def cpu_small_machine_env(env) -> None:
    """vLLM on CPU keeps one core per engine for its scheduler and runs the model on the rest: on a machine of
    4 cores or fewer that idles a large share of it. Measured here (2 cores, SmolLM2-135M, 64 sequences x 48
    tokens): 143 -> 220 tok/s fp32, 263 -> 423 bf16 with no core reserved (`benchmarks/scale.py raw_vllm`).
    An explicit VLLM_CPU_NUM_OF_RESERVED_CPU is kept."""
    if not torch.cuda.is_available() and len(os.sched_getaffinity(0)) <= 4:
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


class VLLMEngine:
    """Engine protocol implementation on a `vllm.LLM` of this process (its engine core here or in a child).

    Args:
        model_dir: a local HF model folder (safetensors weights, config, tokenizer).
        tokenizer: rollwise's tokenizer of that model (EOS ids, stop strings, response text).
        dtype: torch.float32 / bfloat16 / float16.
        max_batch_size: `max_num_seqs`, sequences decoded together.
        seed: vLLM's seed (the stream of unseeded requests).
        max_model_len: longest prompt + response in tokens.
        options: extra `vllm.LLM` keyword arguments; rollwise keys among them: `in_process` (default False; True:
            the engine core runs in this process and weights sync from tensors; `rollwise.generate.factory` sets
            it for a training run's engine), `kv_cache_memory_bytes` (CPU default 256 MiB; unset on CUDA, where
            `gpu_memory_utilization` sizes the cache), `enable_sleep_mode` (CUDA: `release_memory` and
            `resume_memory` act), `enforce_eager` (default False: compiled), `enable_lora` and `max_lora_rank`
            (LoRA adapters), `weight_transfer_backend` (CUDA, engine core in a child: 'ipc' default, or 'nccl').
        sync_dir: where `update_weights` writes its safetensors folders (default: a temporary folder); unused
            while the engine core runs in this process.

    `caps.adapters`: `update_adapter` needs the engine started with LoRA (`enable_lora`); it refuses otherwise.
    `caps.tensors` holds on an instance whose engine core runs in this process only.
    """

    caps = EngineCaps(probe_logprobs=True, continue_aborted=True, adapters=True, reload_from=True, tensors=True,
                      sleep_mode=True)

    def __init__(self, model_dir, tokenizer, dtype: torch.dtype = torch.float32, max_batch_size: int = 64,
                 seed: int = 0, max_model_len: int = 2048, options: dict | None = None,
                 sync_dir: Path | None = None):
        import vllm

        if dtype not in _DTYPES:
            raise ValueError(f"VLLMEngine dtype {dtype} is not one of {', '.join(map(str, _DTYPES))}")
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        cpu_small_machine_env(os.environ)
        self.model_dir = Path(model_dir)
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.sync_dir = Path(sync_dir) if sync_dir is not None else None
        self._own_sync_dir: Path | None = None
        self.version: int | None = 0
        self._failed_version: int | None = None
        self.stats = EngineStats()
        self._aborted: set[int] = set()
        self._lock = threading.Lock()
        self._calls = itertools.count()
        self._lora = None
        self._lora_ids = itertools.count(1)
        self._closed = False
        self._sleeping: set[str] = set()  # sleep-mode tags released and not taken back yet
        self._checkpoint: tuple[set[str], bool] | None = None  # (tensor names, tied head) of model_dir
        config = _read_config(self.model_dir)
        self.vocab_size = int(config.get("vocab_size") or len(tokenizer))
        self.eos_ids = _eos_ids(_ConfigView(self.model_dir, config), tokenizer)
        options = dict(options or {})
        in_process = bool(options.pop("in_process", False))
        if in_process and not vllm_inprocess.can_start():
            print("rollwise: a vLLM engine already runs in this process; this one starts its engine core in a "
                  "process of its own (weights sync through safetensors folders)", flush=True)
            in_process = False
        cuda = torch.cuda.is_available() and _on_cuda()
        kwargs, self.weight_transfer_backend = llm_kwargs(self.model_dir, dtype, max_batch_size, seed,
                                                          max_model_len, options, cuda=cuda, in_process=in_process)
        self.lora_enabled = bool(kwargs.get("enable_lora"))
        self.sleep_mode = cuda and bool(kwargs.get("enable_sleep_mode"))
        if in_process:
            with vllm_inprocess.start():
                self.llm = vllm.LLM(**kwargs)
        else:
            self.llm = vllm.LLM(**kwargs)
        self.in_process = vllm_inprocess.runs_here(self.llm)
        if self.in_process:
            vllm_inprocess.register(self)
        else:  # weights reach a child process through folders: `tensors` is not this instance's cheap path
            self.caps = dataclasses.replace(type(self).caps, tensors=False)
        self.device = torch.device("cuda") if cuda else torch.device("cpu")

    @classmethod
    def from_model(cls, model, tokenizer, folder: str | Path, **kwargs) -> "VLLMEngine":
        """Save a HF model object + tokenizer to `folder` (safetensors), then start an engine on it."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        return cls(folder, tokenizer, **kwargs)

    # -- protocol ---------------------------------------------------------------------------------------
    def abort(self, request_ids: list[int]) -> None:
        with self._lock:
            self._aborted.update(request_ids)

    def generate(self, requests: list[GenerationRequest], on_finish=None) -> list[GenerationResult]:
        """Run every request to completion (or abort); results in request order.

        Each request may carry its own SamplingParams. `on_finish(result)` is called as each one finishes
        (between engine steps) and may call `abort` on the others; an aborted request keeps its tokens.
        """
        self._check_usable()
        results: dict[int, GenerationResult] = {}
        try:
            self._run(requests, results, on_finish)
        finally:
            with self._lock:
                self._aborted.difference_update(r.request_id for r in requests)
        return [results[r.request_id] for r in requests]

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load `state_dict` (HF names, the whole model) and adopt `version`: handed to the model's `load_weights`
        in the engine's dtype when the engine core runs in this process (`rollwise.generate.vllm_inprocess`),
        else written as a safetensors folder that the worker reloads. A partial state dict is refused first
        (ValueError, nothing loaded); a load that fails after it began leaves `version = None`."""
        from rollwise.models.weights_folder import (
            checkpoint_names,
            delete_older_versions,
            tied_embeddings,
            whole_state,
            write_version_dir,
        )

        self._check_open()
        if self._checkpoint is None:
            self._checkpoint = checkpoint_names(self.model_dir), tied_embeddings(self.model_dir)
        expected, tied = self._checkpoint
        if not self.in_process:
            folder, _ = write_version_dir(state_dict, version, self._sync_folder(), self.model_dir,
                                          expected=expected, tied=tied, dtype=self.dtype)
            self.reload_from(folder, version)
            delete_older_versions(folder.parent, keep=folder)
            return
        state = whole_state(state_dict, expected, tied)
        self.resume_memory(("weights",))
        self._adopt(version, f"sync of version {version} from tensors",
                    lambda: vllm_inprocess.load_tensors(self.llm, state, self.dtype, version))

    def reload_from(self, path: str | Path, version: int) -> None:
        """Reload every weight from the safetensors folder `path` and adopt `version`.

        On any failure the weights are in an unknown state: `version` becomes None and `generate` refuses.
        """
        self._check_open()
        self.resume_memory(("weights",))
        self._adopt(version, f"reload of version {version} from {path}",
                    lambda: self.llm.collective_rpc("rollwise_reload", args=(str(path), int(version))))

    def _adopt(self, version: int, what: str, load) -> None:
        """`load()` every weight, reset the prefix cache, then adopt `version`; None (weights unknown) until both
        succeeded."""
        self.version = None
        self._failed_version = version
        load()
        if not self.llm.reset_prefix_cache():
            raise EngineStateError(f"{what}: vLLM refused to reset its prefix cache (requests still running?)")
        self.version = int(version)
        self._failed_version = None

    def release_memory(self) -> None:
        """Let go of the GPU memory while the trainer trains: vLLM's sleep level 1 (weights copied to CPU memory,
        KV cache and prefix cache dropped). A no-op unless the engine was started with `enable_sleep_mode` on
        CUDA. A weight sync takes the weights back first, the next generation or probe the KV cache."""
        self._check_open()
        if not self.sleep_mode or self._sleeping:
            return
        self.llm.sleep(level=1)
        self._sleeping = {"weights", "kv_cache"}

    def resume_memory(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Take back what `release_memory` let go of, among `tags` ('weights' before a weight sync, 'kv_cache'
        before generating); a no-op for what is resident already."""
        wake = [t for t in ("weights", "kv_cache") if t in tags and t in self._sleeping]
        if wake:
            self.llm.wake_up(tags=wake)
            self._sleeping.difference_update(wake)

    def update_adapter(self, adapter_dir: str | Path, version: int) -> None:
        """Sample later calls with the PEFT adapter saved in `adapter_dir`, as `version` (a new LoRA id)."""
        from vllm.lora.request import LoRARequest

        self._check_open()
        self.resume_memory(("weights",))
        if not self.lora_enabled:
            raise ValueError("update_adapter: the vLLM engine was started without LoRA; set "
                             "rollout.engine_options = {enable_lora = true, max_lora_rank = R}")
        old = self._lora
        self._lora = LoRARequest(f"v{version}", next(self._lora_ids), str(adapter_dir))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        self.version = int(version)

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs at temperature 1 of token_ids[1:] given the preceding tokens (length len - 1), computed
        by the current weights (and adapter) via vLLM's `prompt_logprobs`."""
        import vllm
        from vllm.inputs import TokensPrompt

        self._check_usable()
        if len(token_ids) < 2:
            return []
        params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(token_ids))], params, use_tqdm=False,
                                lora_request=self._lora)[0]
        return [float(step[tok].logprob) for tok, step in zip(token_ids[1:], out.prompt_logprobs[1:])]

    def close(self) -> None:
        """Shut the engine core down (its processes exit) and remove the temporary sync folder; idempotent."""
        if self._closed:
            return
        self._closed = True
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            finally:
                del llm
                gc.collect()
                if self.in_process:
                    vllm_inprocess.closed(self)
        if self._own_sync_dir is not None:
            shutil.rmtree(self._own_sync_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals --------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineStateError("the vLLM engine is closed")

    def _check_usable(self) -> None:
        """Before generating: open, weights of a known version, and the memory sleep mode let go of taken back."""
        self._check_open()
        if self.version is None:
            raise EngineStateError(f"engine weights are in an unknown state after a failed sync at version "
                                   f"{self._failed_version}; sync the weights again before generating")
        self.resume_memory()

    def _sync_folder(self) -> Path:
        if self.sync_dir is not None:
            return self.sync_dir
        if self._own_sync_dir is None:
            self._own_sync_dir = Path(tempfile.mkdtemp(prefix="rollwise-vllm-sync-"))
        return self._own_sync_dir

    def _run(self, requests: list[GenerationRequest], results: dict, on_finish) -> None:
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        call = next(self._calls)
        live: dict[str, _Live] = {}
        seeds = _request_seeds(requests)
        for req in requests:
            seq = self._start(req)
            if seq.status is not None:
                self._finish(seq, results, on_finish)
                continue
            ext_id = f"rw{call}-{req.request_id}"
            prompt = TokensPrompt(prompt_token_ids=list(req.prompt_ids) + list(req.response_ids))
            engine.add_request(ext_id, prompt, self._vllm_params(req, seeds[req.request_id]),
                               lora_request=self._lora)
            self.stats.prefill_tokens += len(prompt["prompt_token_ids"])
            self.stats.prefill_sequences += 1
            live[ext_id] = seq
        try:
            while live:
                self._apply_aborts(live, results, on_finish)
                if not live:
                    break
                for out in engine.step():
                    seq = live.get(out.request_id)
                    if seq is None:
                        continue
                    self._absorb(seq, out)
                    if out.finished:
                        del live[out.request_id]
                        self._finish(seq, results, on_finish)
                self.stats.decode_steps += 1
        finally:
            if live:  # an exception (or Ctrl-C) mid-call: leave no request running in the engine
                engine.abort_request(list(live))

    def _start(self, req: GenerationRequest) -> _Live:
        params = req.params
        truncating = params.temperature != 0.0 and _truncates(params, self.vocab_size)
        full = None if truncating else list(req.response_full_logprobs or req.response_logprobs)
        seq = _Live(req, list(req.response_ids), list(req.response_logprobs), full, len(req.response_ids))
        if seq.start_len >= params.max_new_tokens:
            seq.status = Status.TRUNCATED
        elif req.request_id in self._aborted:
            seq.status = Status.ABORTED
        return seq

    def _vllm_params(self, req: GenerationRequest, seed: int | None):
        import vllm
        from vllm.sampling_params import RequestOutputKind

        p = req.params
        return vllm.SamplingParams(
            n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else 0,
            max_tokens=p.max_new_tokens - len(req.response_ids), seed=seed, stop=list(p.stop) or None,
            stop_token_ids=sorted(self.eos_ids), logprobs=0, output_kind=RequestOutputKind.DELTA,
            detokenize=bool(p.stop), skip_special_tokens=False)

    def _absorb(self, seq: _Live, out) -> None:
        """Append the new tokens of a delta output (ids, sampled-token log-probs) to the sequence."""
        completion = out.outputs[0]
        new_ids = list(completion.token_ids)
        steps = completion.logprobs or []
        if len(steps) != len(new_ids):
            raise RuntimeError(f"vLLM returned {len(new_ids)} tokens but {len(steps)} log-probs for request "
                               f"{seq.req.request_id}")
        lps = [float(step[tok].logprob) for tok, step in zip(new_ids, steps)]
        seq.ids.extend(new_ids)
        seq.logprobs.extend(lps)
        if seq.full_logprobs is not None:
            seq.full_logprobs.extend(lps)
        self.stats.generated_tokens += len(new_ids)
        self.stats.active_slot_steps += len(new_ids)
        if out.finished:
            reason = completion.finish_reason
            seq.status = _FINISH.get(reason, Status.COMPLETED)

    def _apply_aborts(self, live: dict[str, _Live], results: dict, on_finish) -> None:
        with self._lock:
            hit = [ext for ext, seq in live.items() if seq.req.request_id in self._aborted]
        if not hit:
            return
        self.llm.llm_engine.abort_request(hit)
        for ext in hit:
            seq = live.pop(ext)
            seq.status = Status.ABORTED
            self._finish(seq, results, on_finish)

    def _finish(self, seq: _Live, results: dict, on_finish) -> None:
        # spans of this call only; the caller keeps the spans of tokens generated earlier
        spans = [(seq.start_len, len(seq.ids), self.version)] if len(seq.ids) > seq.start_len else []
        text = self.tokenizer.decode(seq.ids, skip_special_tokens=True)
        if seq.status == Status.COMPLETED and seq.req.params.stop:
            text = _cut_at_stop(text, seq.req.params.stop)
        result = GenerationResult(seq.req.request_id, seq.ids, seq.logprobs, seq.status, spans, text,
                                  full_logprobs=seq.full_logprobs if seq.full_logprobs is not None else [])
        results[seq.req.request_id] = result
        if on_finish is not None:
            on_finish(result)


def _truncates(params: SamplingParams, vocab_size: int) -> bool:
    return 0 < params.top_k < vocab_size or params.top_p < 1.0


def _request_seeds(requests: list[GenerationRequest]) -> dict[int, int | None]:
    """Per-request vLLM seeds. vLLM seeds each request's own generator, so k requests with one seeded params
    value would all draw the same tokens; the k-th of them (in request order) gets `seed + k * 1_000_003`,
    giving distinct, reproducible samples (the torch engine draws them from one generator instead)."""
    seen: dict[SamplingParams, int] = {}
    seeds: dict[int, int | None] = {}
    for r in requests:
        if r.params.seed is None:
            seeds[r.request_id] = None
            continue
        k = seen.get(r.params, 0)
        seen[r.params] = k + 1
        seeds[r.request_id] = (r.params.seed + k * _SEED_STRIDE) % (2**63)
    return seeds


def _read_config(model_dir: Path) -> dict:
    import json

    path = model_dir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{model_dir}: no config.json; VLLMEngine needs a saved HF model folder "
                                f"(VLLMEngine.from_model saves one)")
    config = json.loads(path.read_text())
    return {**(config.get("text_config") or {}), **config}


class _ConfigView:
    """What `_eos_ids` reads from a model object (config and generation config eos ids), from the folder."""

    def __init__(self, model_dir: Path, config: dict):
        import json
        from types import SimpleNamespace

        self.config = SimpleNamespace(eos_token_id=config.get("eos_token_id"))
        gen = model_dir / "generation_config.json"
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
        self.generation_config = SimpleNamespace(eos_token_id=eos)


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()
