"""`POST /v1/weights` of `rollwise serve`: read new policy weights from the request, check them whole.

Two forms:
- a safetensors body (`Content-Type` other than JSON) with `?version=N` (or `X-Policy-Version: N`), at most
  `serve.max_weights_mb`;
- JSON `{"path": ..., "version": N}`: a safetensors file, or a folder of `*.safetensors` files, under
  `serve.weights_root` (unset = path loading is off). The path (absolute, or relative to the root) is resolved
  (symlinks, `..`) before it is checked, and every file a folder holds is checked the same way. Every refused
  path gets the same answer, `PATH_REFUSED`, whether it is outside the root, missing, not a file or not named
  `*.safetensors`: the answer says nothing about the server's file system.

The weights must be the served model's whole parameter set (`rollwise.models.weights_folder.check_whole`, the
check the Sync stage makes): known names, the model's shapes, finite values, and no parameter missing. A
partial state dict is refused, so the policy version never moves without the weights.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollwise.errors import one_line
from rollwise.serve.protocol import BadRequest, parse_json, read_body

PATH_REFUSED = ("path refused: the server loads a safetensors file, or a folder of *.safetensors files, under "
                "serve.weights_root; send the weights as a safetensors body otherwise")
PATH_OFF = ("loading weights from a path is off on this server (serve.weights_root is unset); send the weights "
            "as a safetensors body (POST /v1/weights?version=N)")


async def read_weights(request, service) -> tuple[dict, int]:
    """(state dict, version) of `POST /v1/weights` (see the module docstring); BadRequest (400, or 413 for a
    body over its limit) on anything else."""
    cfg = service.serve_cfg
    if request.headers.get("content-type", "").startswith("application/json"):
        body = parse_json(await read_body(request, cfg.max_body_mb, "max_body_mb"))
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object {path, version}")
        version, path = body.get("version"), body.get("path")
        if not isinstance(path, str) or not path:
            raise BadRequest("path must name a safetensors file or a folder of them under serve.weights_root")
        if cfg.weights_root is None:
            raise BadRequest(PATH_OFF)
        state = await asyncio.to_thread(load_path, path, cfg.weights_root)
    else:
        raw = request.query_params.get("version", request.headers.get("x-policy-version"))
        try:
            version = int(raw) if raw is not None else None
        except ValueError:
            raise BadRequest(f"version must be an integer, got {raw!r}") from None
        data = await read_body(request, cfg.max_weights_mb, "max_weights_mb")
        if not data:
            raise BadRequest("the body is empty: send the weights as safetensors bytes")
        state = await asyncio.to_thread(load_bytes, data)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise BadRequest(f"version must be an integer >= 0 (?version=N or JSON 'version'), got {version!r}")
    await asyncio.to_thread(check_state, state, service.worker.engine)
    return state, version


def load_bytes(data: bytes) -> dict:
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as exc:
        raise BadRequest(f"the body is not a safetensors file: {one_line(str(exc))}") from None


def weight_files(raw: str, root: str | Path) -> list[Path]:
    """The safetensors files `raw` names under `root`: the file itself, or the `*.safetensors` of a folder;
    BadRequest(PATH_REFUSED) for anything else, the same for every reason."""
    try:
        base = Path(root).resolve(strict=True)
        target = (base / raw).resolve()  # an absolute `raw` replaces `base`
        if not target.is_relative_to(base):
            raise BadRequest(PATH_REFUSED)
        if target.is_dir():
            files = [f.resolve() for f in sorted(target.glob("*.safetensors"))]
        else:
            files = [target]
        if files and all(f.is_relative_to(base) and f.is_file() and f.suffix == ".safetensors" for f in files):
            return files
    except (OSError, ValueError, RuntimeError):  # unreadable, NUL in the name, a symlink loop
        pass
    raise BadRequest(PATH_REFUSED)


def load_path(raw: str, root: str | Path) -> dict:
    """Every tensor of the files `weight_files(raw, root)` names."""
    from safetensors.torch import load_file

    state = {}
    for f in weight_files(raw, root):
        try:
            state.update(load_file(str(f)))
        except Exception as exc:
            raise BadRequest(f"{f.name} (under serve.weights_root) is not a safetensors file: "
                             f"{one_line(str(exc))}") from None
    return state


def check_state(state: dict, engine) -> None:
    """The weights are the served model's whole parameter set: every tensor names a parameter (or a tied
    alias) with its shape and holds finite values, and no parameter is missing. Engines without a local model
    (vLLM) make the same check when they load (`rollwise.models.weights_folder.check_whole`)."""
    import torch

    from rollwise.models.weights_folder import check_whole

    if not state:
        raise BadRequest("the weights hold no tensor")
    if not engine.caps.local_model:
        return
    model = engine.model
    own = model.state_dict()
    unknown = [k for k in state if k not in own]
    if unknown:
        raise BadRequest(f"{len(unknown)} tensor names are not parameters of the served model, e.g. {unknown[0]!r}")
    wrong = [k for k, t in state.items() if tuple(t.shape) != tuple(own[k].shape)]
    if wrong:
        k = wrong[0]
        raise BadRequest(f"tensor {k!r} has shape {tuple(state[k].shape)}, the served model's is {tuple(own[k].shape)}")
    params = {name for name, _ in model.named_parameters()}
    try:  # a tied head (`lm_head.weight`) is an alias of a parameter: it may come or not
        check_whole({k: t for k, t in state.items() if k in params}, params)
    except ValueError as exc:
        raise BadRequest(one_line(str(exc))) from None
    bad = next((k for k, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:
        raise BadRequest(f"tensor {bad!r} holds NaN or Inf values; the policy was left as it was")
