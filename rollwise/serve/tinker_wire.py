"""The Tinker API's wire format, both ways: what the official `tinker` SDK (0.38) sends and expects back.

Most calls are JSON. Two are protocol buffers, with the SDK's own generated module (`tinker.proto`):
`POST /api/v1/forward_backward` sends a `ForwardBackwardRequest` (`Content-Type: application/x-protobuf`), and the
results of forward/backward and of sampling come back as `ForwardBackwardOutput` / `SampleResponse` messages
when the SDK asks for them (`Accept: application/x-protobuf` on `retrieve_future`). Token ids travel as int32
bytes, tensors as dense (or CSR) bytes with a dtype and shape.

Everything here is pure conversion: `BadRequest` (400, one line naming the field) for what a client got wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rollwise.serve.protocol import BadRequest

PROTO = "application/x-protobuf"
LOSSES = ("cross_entropy", "importance_sampling", "ppo")  # what forward_backward computes here
LOSS_INPUTS = {  # loss_fn_inputs each built-in loss needs (besides target_tokens)
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
}


def _pb():
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("rollwise serve --api tinker needs the tinker SDK's wire format: "
                          "pip install 'rollwise[tinker]'") from exc
    return tinker_public_pb2


@dataclass
class Datum:
    """One `types.Datum`: the input token ids and its loss inputs as flat arrays (each as long as `tokens`)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    data: list[Datum]
    forward_only: bool


def _tensor(msg, where: str) -> np.ndarray:
    """A proto `Tensor` as a dense numpy array (CSR entries that are absent are 0)."""
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise BadRequest(f"{where}: tensor dtype {msg.dtype} is not float32 or int64")
    dtype = dtypes[msg.dtype]
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise BadRequest(f"{where}: a sparse tensor needs a 2-D shape and matching CSR indices")
        dense = np.zeros(shape, dtype=dtype)
        for row in range(shape[0]):
            dense[row, col[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
        return dense
    flat = np.frombuffer(msg.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != flat.size:
        raise BadRequest(f"{where}: shape {shape} does not match its {flat.size} values")
    return flat.reshape(shape) if shape else flat


def parse_forward_backward(body: bytes) -> FwdBwdRequest:
    """A `ForwardBackwardRequest` proto body -> FwdBwdRequest (`check_loss_inputs` checks it against the model)."""
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception:  # protobuf's DecodeError
        raise BadRequest("forward_backward: the body is not a ForwardBackwardRequest protocol buffer") from None
    config = {k: v.number for k, v in msg.loss_fn_config_v2.items() if v.WhichOneof("value") == "number"}
    config.update({k: float(v) for k, v in msg.loss_fn_config.items() if k not in config})
    data = []
    for i, d in enumerate(msg.data):
        where = f"data[{i}]"
        tokens: list[int] = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise BadRequest(f"{where}.model_input: only token chunks (EncodedTextChunk) are supported, got "
                                 f"{chunk.WhichOneof('chunk')}")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        if not tokens:
            raise BadRequest(f"{where}.model_input is empty")
        inputs = {name: _tensor(t, f"{where}.loss_fn_inputs[{name!r}]") for name, t in d.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    if not data:
        raise BadRequest("forward_backward: data is empty")
    return FwdBwdRequest(msg.model_id, msg.seq_id, msg.loss_fn, config, data, msg.forward_only)


def check_loss_inputs(req: FwdBwdRequest, vocab_size: int, context: int) -> None:
    """The loss is one of LOSSES, token ids are in the vocabulary, and every datum carries the loss inputs it
    needs, each one value per input token and finite; checked when the call arrives, so the worker only computes."""
    if req.loss_fn not in LOSSES:
        raise BadRequest(f"loss_fn {req.loss_fn!r} is not supported by rollwise serve: use one of "
                         f"{', '.join(LOSSES)} (custom losses run on the client with forward_backward_custom "
                         "only where the server supports it, which this one does not)")
    for i, d in enumerate(req.data):
        if len(d.tokens) > context:
            raise BadRequest(f"data[{i}].model_input has {len(d.tokens)} tokens, over the model's context of "
                             f"{context}")
        need = ("target_tokens",) + LOSS_INPUTS[req.loss_fn]
        missing = [k for k in need if k not in d.inputs and not (k == "weights" and req.forward_only)]
        if missing:
            raise BadRequest(f"data[{i}].loss_fn_inputs lacks {missing} ({req.loss_fn} needs {list(need)})")
        for name, arr in d.inputs.items():
            if arr.ndim != 1 or arr.size != len(d.tokens):
                raise BadRequest(f"data[{i}].loss_fn_inputs[{name!r}] has shape {list(arr.shape)}; it must be "
                                 f"[{len(d.tokens)}], one value per input token")
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise BadRequest(f"data[{i}].loss_fn_inputs[{name!r}] holds NaN or Infinity")
        check_token_ids(d.tokens, vocab_size, f"data[{i}].model_input")
        check_token_ids(d.inputs["target_tokens"].astype(np.int64).tolist(), vocab_size,
                        f"data[{i}].loss_fn_inputs['target_tokens']")


def check_token_ids(ids: list[int], vocab_size: int, where: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"{where}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


def encode_forward_backward(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """Per-datum float32 outputs (e.g. `logprobs`, `elementwise_loss`, each [n_i]) and metrics ->
    `ForwardBackwardOutput` bytes: one `ArrayRecord` whose fields concatenate the datums, with byte offsets."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in (outputs[0] if outputs else {}):
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = pb.DTYPE_FLOAT32
    return msg.SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop: bool  # ended at EOS or a stop sequence (else it reached max_tokens)


def encode_sample(sequences: list[Sequence], prompt_logprobs: list[float | None] | None) -> bytes:
    """`SampleResponse` bytes; a prompt log-prob that does not exist (the first token's) travels as NaN, which the
    SDK reads back as None."""
    pb = _pb()
    msg = pb.SampleResponse()
    for s in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stop else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return msg.SerializeToString()


@dataclass
class SampleSpec:
    """A `SampleRequest` as the worker needs it."""

    sampler_id: str
    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0 = off
    stop: tuple[str, ...] | None  # None: EOS only; strings (token-id stops are decoded to their text)
    stop_ids: tuple[int, ...]
    seed: int | None
    prompt_logprobs: bool


def parse_sample(body: dict, max_samples: int) -> SampleSpec:
    """`POST /api/v1/asample` JSON -> SampleSpec (BadRequest naming the field)."""
    sampler = body.get("sampling_session_id")
    if not isinstance(sampler, str) or not sampler:
        raise BadRequest("sampling_session_id is required (create the sampling client with "
                         "save_weights_and_get_sampling_client() or create_sampling_client())")
    prompt = model_input_tokens(body.get("prompt"), "prompt")
    n = body.get("num_samples", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_samples:
        raise BadRequest(f"num_samples must be an integer in 1..{max_samples}, got {n!r}")
    for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if body.get(key):
            raise BadRequest(f"{key} is not supported by rollwise serve (sampled and prompt log-probs are)")
    for key in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
        if body.get(key) is not None:
            raise BadRequest(f"{key} is not supported by rollwise serve")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    max_tokens = params.get("max_tokens")
    if max_tokens is None:
        raise BadRequest("sampling_params.max_tokens is required by rollwise serve (e.g. SamplingParams("
                         "max_tokens=64))")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
        raise BadRequest(f"sampling_params.max_tokens must be an integer > 0, got {max_tokens!r}")
    temperature = _float(params, "temperature", 1.0, low=0.0)
    top_p = _float(params, "top_p", 1.0, low=0.0)
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    top_k = params.get("top_k", -1)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise BadRequest(f"sampling_params.top_k must be -1 (off) or an integer >= 1, got {top_k!r}")
    seed = params.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"sampling_params.seed must be an integer, got {seed!r}")
    stop, stop_ids = _stops(params.get("stop"))
    return SampleSpec(sampler, prompt, n, max_tokens, temperature, top_p, max(top_k, 0), stop, stop_ids, seed,
                      bool(body.get("prompt_logprobs")))


def _float(params: dict, key: str, default: float, low: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise BadRequest(f"sampling_params.{key} must be a number >= {low:g}, got {value!r}")
    return float(value)


def _stops(stop) -> tuple[tuple[str, ...] | None, tuple[int, ...]]:
    if stop is None:
        return None, ()
    if isinstance(stop, str):
        return (stop,), ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop), ()
    if isinstance(stop, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        return (), tuple(stop)
    raise BadRequest("sampling_params.stop must be a string, a list of strings or a list of token ids")


def model_input_tokens(value, where: str) -> list[int]:
    """The token ids of a JSON `ModelInput` ({"chunks": [{"type": "encoded_text", "tokens": [...]}]})."""
    if not isinstance(value, dict) or not isinstance(value.get("chunks"), list):
        raise BadRequest(f"{where} must be a ModelInput (ModelInput.from_ints(token_ids))")
    tokens: list[int] = []
    for i, chunk in enumerate(value["chunks"]):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise BadRequest(f"{where}.chunks[{i}]: only token chunks (EncodedTextChunk) are supported, got {kind}")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest(f"{where}.chunks[{i}].tokens must be a list of token ids")
        tokens.extend(ids)
    if not tokens:
        raise BadRequest(f"{where} is empty")
    return tokens
