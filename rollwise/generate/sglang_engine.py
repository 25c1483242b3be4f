"""Client of SGLang's native HTTP API as a rollout engine (`rollout.engine = "sglang"`), on the shared server
client of `rollwise.generate.http_engine` (concurrent calls, abort and continue, one-line errors).

SGLang needs CUDA: this client is tested against tests/fake_sglang_server.py (a real HTTP process that speaks
SGLang's documented protocol with a real model) and checked against the real server on a GPU machine only.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
import httpx
import torch
from rollwise.types import SamplingParams, Status

from rollwise.generate.base import EngineCaps
from rollwise.generate.http_engine import (ServerEngineError, _error_message, _ServerEngine, _Sequence, as_dtype,
                                           push_through_folder)


class SGLangEngine(_ServerEngine):
    """Client of SGLang's native HTTP API (`/generate` with `input_ids`, `/abort_request`,
    `/update_weights_from_disk`, `/flush_cache`).

    Written from SGLang's documented protocol (`GenerateReqInput`, `meta_info.output_token_logprobs` =
    [[logprob, token_id, text], ...], `meta_info.finish_reason.type` in stop/length/abort) and tested against
    tests/fake_sglang_server.py; a real SGLang server (it needs CUDA) is checked only on a GPU machine.

    Log-probs: SGLang reports log-probs after temperature but before top-k / top-p (unless started with
    SGLANG_RETURN_ORIGINAL_LOGPROB, which gives raw ones): these are the untruncated `full_logprobs`; they are
    also the behaviour log-probs when no top-k / top-p applies. With top-k / top-p the behaviour log-probs are
    not reported by SGLang and the same values are returned (an under-estimate by -log(kept mass)).

    Args:
        base_url: e.g. "http://127.0.0.1:30000".
        tokenizer: EOS ids and response text.
        timeout_s: rollout.request_timeout_s.
        max_concurrency: HTTP calls in flight at once.
        dtype: the compute dtype; None reads `/get_server_info` ('auto' stays None = unknown).
        sync_dir: where `update_weights` writes safetensors folders (default: a temporary directory).
        model_dir: HF folder whose config files are copied next to synced weights (SGLang reads them).
    """

    server_name = "SGLang"
    caps = EngineCaps(probe_logprobs=True, continue_aborted=True, reload_from=True)

    def __init__(self, base_url: str, tokenizer, timeout_s: float = 600.0, max_concurrency: int = 64,
                 dtype=None, version: int = 0, sync_dir: str | Path | None = None,
                 model_dir: str | Path | None = None):
        super().__init__(base_url, tokenizer, timeout_s, max_concurrency, dtype, version)
        info = self._get("/get_server_info")
        if self.dtype is None:
            self.dtype = as_dtype(info.get("dtype"))
        self.server_version = info.get("version")
        self.model_dir = Path(model_dir) if model_dir else (Path(info["model_path"]) if info.get("model_path")
                                                            else None)
        self.sync_dir = Path(sync_dir) if sync_dir else None

    def _payload(self, seq: _Sequence) -> dict:
        p: SamplingParams = seq.req.params
        params = {"max_new_tokens": seq.remaining, "temperature": p.temperature, "top_p": p.top_p,
                  "top_k": p.top_k if p.top_k > 0 else -1, "stop_token_ids": self.eos_ids,
                  "skip_special_tokens": False, "no_stop_trim": True}
        if p.stop:
            params["stop"] = list(p.stop)
        if p.seed is not None:
            params["sampling_seed"] = p.seed
        return {"rid": seq.rid, "input_ids": seq.req.prompt_ids + seq.ids, "sampling_params": params,
                "return_logprob": True, "logprob_start_len": -1, "stream": False}

    async def _run_one(self, client: httpx.AsyncClient, seq: _Sequence) -> None:
        path, what = "/generate", f"request {seq.req.request_id}"
        try:
            answer = await client.post(f"{self.base_url}{path}", json=self._payload(seq))
        except httpx.HTTPError as exc:
            raise self._fail(path, exc, what) from None
        if answer.status_code >= 400:
            raise self._answer_error(path, answer.status_code, answer.content)
        meta = answer.json().get("meta_info") or {}
        rows = meta.get("output_token_logprobs")
        if rows is None:
            raise ServerEngineError(f"{self.base_url}{path} returned no meta_info.output_token_logprobs; the "
                                    "server must honour return_logprob = true")
        seq.add([int(r[1]) for r in rows], [float(r[0]) for r in rows], full_known=True)
        reason = (meta.get("finish_reason") or {}).get("type")
        seq.status = {"length": Status.TRUNCATED, "stop": Status.COMPLETED, "abort": Status.ABORTED}.get(reason)

    def _abort_on_loop(self, request_ids: list[int]) -> None:
        """Ask the server to abort; the pending `/generate` answers with the tokens so far. An abort that reaches
        the server before the request does is lost: that request then simply runs to its end."""
        for rid in request_ids:
            seq = self._inflight.get(rid)
            if seq is not None and seq.sent and seq.status is None:
                asyncio.ensure_future(self._send_abort(seq.rid))

    async def _send_abort(self, rid: str) -> None:
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                answer = await client.post(f"{self.base_url}/abort_request", json={"rid": rid})
        except httpx.HTTPError:
            return  # the request still ends on its own; an abort is only a hint
        del answer

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs at temperature 1 of token_ids[1:] given the tokens before them (length len - 1):
        `/generate` with `return_logprob` and `logprob_start_len = 0` (`meta_info.input_token_logprobs`)."""
        body = {"input_ids": list(token_ids), "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": 0}
        rows = self._post("/generate", body, what="probe_logprobs")["meta_info"]["input_token_logprobs"]
        return [float(r[0]) for r in rows[1:len(token_ids)]]

    def reload_from(self, path: str | Path, version: int) -> None:
        """Load the weights of an HF folder (`/update_weights_from_disk`), flush the prefix cache, adopt
        `version`. On failure the version becomes unknown and `generate` refuses until the next good sync."""
        self.version = None
        answer = self._post("/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)},
                            what=f"sync to version {version}")
        if isinstance(answer, dict) and answer.get("success") is False:
            raise ServerEngineError(f"{self.base_url}/update_weights_from_disk refused {path}: "
                                    f"{_error_message(json.dumps(answer))}")
        self._post("/flush_cache", what="after the weight update")
        self.version = version

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Write `state_dict` as a safetensors HF folder under `sync_dir`, then `reload_from` it."""
        push_through_folder(self, state_dict, version)
