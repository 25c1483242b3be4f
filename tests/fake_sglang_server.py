"""A small real HTTP server that speaks SGLang's native protocol from a tiny in-process torch model, so the
SGLang client can be tested where SGLang itself cannot run (it needs CUDA).

Run: `python tests/fake_sglang_server.py MODEL_DIR [--port 0]`; it prints `listening on http://127.0.0.1:PORT`.

Routes, as in sglang/srt/entrypoints/http_server.py (fields of io_struct.GenerateReqInput and friends):
- `POST /generate` {input_ids, sampling_params {max_new_tokens, temperature, top_p, top_k (-1 = off),
  stop_token_ids, stop, sampling_seed}, return_logprob, logprob_start_len, rid} ->
  {text, output_ids, meta_info {id, finish_reason {type: stop|length|abort}, prompt_tokens, completion_tokens,
  output_token_logprobs [[logprob, token_id, None], ...], input_token_logprobs (logprob_start_len >= 0)}}.
  Log-probs follow SGLang's default: after temperature, before top-k / top-p; greedy (temperature 0) samples
  the argmax and reports temperature-1 log-probs. A bad request answers 400 {object: "error", message, ...}.
- `POST /abort_request` {rid}: the pending /generate stops at its next token with finish_reason abort.
- `POST /update_weights_from_disk` {model_path}: loads `model.safetensors` of the folder
  ({success, message}; 400 with success false when it cannot).
- `GET|POST /flush_cache`, `GET /health`, `GET /get_model_info`, `GET /get_server_info`.
- Test control (not SGLang): `POST /rollwise_test/delay {seconds}` sleeps that long before each token.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollwise.generate.sampling import truncate_logits  # noqa: E402


class FakeSGLang:
    """The model, its lock, and the state the routes share."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.lock = threading.Lock()
        self.aborted: set[str] = set()
        self.delay_s = 0.0
        self.weight_version = "default"
        self.flushes = 0

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Next-token logits [L, V] fp32 of every position of `ids` (a full forward, no cache)."""
        with self.lock:
            return self.model(input_ids=torch.tensor([ids])).logits[0].float()

    def generate(self, body: dict) -> tuple[int, dict]:
        ids = body.get("input_ids")
        vocab = self.model.config.vocab_size
        if not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            return 400, {"object": "error", "message": f"input_ids must be token ids in [0, {vocab})",
                         "type": "BadRequestError", "param": None, "code": 400}
        params = body.get("sampling_params") or {}
        rid = body.get("rid") or f"fake-{time.monotonic_ns()}"
        meta = {"id": rid, "prompt_tokens": len(ids), "weight_version": self.weight_version}
        start = body.get("logprob_start_len")
        if body.get("return_logprob") and start is not None and start >= 0:
            meta["input_token_logprobs"] = self._input_logprobs(ids, int(start))
        out, rows, reason = self._sample(ids, params, rid)
        meta.update(finish_reason=reason, completion_tokens=len(out))
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = rows
        self.aborted.discard(rid)
        return 200, {"text": self.tokenizer.decode(out), "output_ids": out, "meta_info": meta}

    def _input_logprobs(self, ids: list[int], start: int) -> list:
        logprobs = torch.log_softmax(self.logits(ids), dim=-1)  # [L, V]
        rows = [[None if i == 0 else float(logprobs[i - 1, t]), t, None] for i, t in enumerate(ids)]
        return rows[start:]

    def _sample(self, ids: list[int], params: dict, rid: str) -> tuple[list[int], list, dict]:
        max_new = int(params.get("max_new_tokens", 128))
        temperature = float(params.get("temperature", 1.0))
        top_k, top_p = int(params.get("top_k", -1)), float(params.get("top_p", 1.0))
        stop_ids = set(params.get("stop_token_ids") or []) | {self.tokenizer.eos_token_id}
        stops = params.get("stop") or []
        gen = torch.Generator().manual_seed(int(params.get("sampling_seed", time.monotonic_ns() % 2**31)))
        out, rows = [], []
        while len(out) < max_new:
            if self.delay_s:
                time.sleep(self.delay_s)
            if rid in self.aborted:
                return out, rows, {"type": "abort", "message": "Abort in waiting queue"}
            logits = self.logits(ids + out)[-1]  # [V]
            if temperature < 1e-5:
                token = int(logits.argmax())
                logprob = float(torch.log_softmax(logits, dim=-1)[token])
            else:
                scaled = logits / temperature
                kept = truncate_logits(scaled[None], max(top_k, 0), top_p)[0]
                token = int(torch.multinomial(torch.softmax(kept, dim=-1), 1, generator=gen))
                logprob = float(torch.log_softmax(scaled, dim=-1)[token])
            out.append(token)
            rows.append([logprob, token, None])
            if token in stop_ids:
                return out, rows, {"type": "stop", "matched": token}
            if stops and any(s in self.tokenizer.decode(out) for s in stops):
                return out, rows, {"type": "stop", "matched": next(s for s in stops if s in self.tokenizer.decode(out))}
        return out, rows, {"type": "length", "length": max_new}

    def update_weights(self, body: dict) -> tuple[int, dict]:
        from safetensors.torch import load_file

        path = Path(body.get("model_path", ""))
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            return 400, {"success": False, "message": f"no safetensors files in {path}", "num_paused_requests": 0}
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        with self.lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
            if missing or unexpected:
                return 400, {"success": False, "message": f"missing {missing}, unexpected {unexpected}",
                             "num_paused_requests": 0}
            self.model.tie_weights()
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}


def make_handler(state: FakeSGLang):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, status: int, payload) -> None:
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            length = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(length) or b"{}") if length else {}

        def do_GET(self):
            if self.path == "/health":
                self._send(200, "")
            elif self.path == "/get_model_info":
                self._send(200, {"model_path": state.model_dir, "is_generation": True,
                                 "weight_version": state.weight_version})
            elif self.path == "/get_server_info":
                self._send(200, {"model_path": state.model_dir, "dtype": "float32", "version": "fake-sglang-0"})
            elif self.path == "/flush_cache":
                state.flushes += 1
                self._send(200, "Cache flushed.\n")
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            body = self._body()
            if self.path == "/generate":
                self._send(*state.generate(body))
            elif self.path == "/abort_request":
                state.aborted.add(body.get("rid", ""))
                self._send(200, "")
            elif self.path == "/update_weights_from_disk":
                self._send(*state.update_weights(body))
            elif self.path == "/flush_cache":
                state.flushes += 1
                self._send(200, "Cache flushed.\n")
            elif self.path == "/rollwise_test/delay":
                state.delay_s = float(body.get("seconds", 0.0))
                self._send(200, {"delay_s": state.delay_s})
            else:
                self._send(404, {"detail": "Not Found"})

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(FakeSGLang(args.model_dir)))
    server.daemon_threads = True
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
