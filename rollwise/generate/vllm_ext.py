"""A vLLM worker extension: versioned weight reloads from a safetensors folder, or from tensors in this process.

vLLM mixes this class into its worker class when started with
`worker_extension_cls="rollwise.generate.vllm_ext.RollwiseWorkerExtension"` (in-process `vllm.LLM`) or
`--worker-extension-cls rollwise.generate.vllm_ext.RollwiseWorkerExtension` (the OpenAI-compatible server);
its methods are then called on every worker through `collective_rpc` (`LLM.collective_rpc(name, args=...)`,
or `POST /collective_rpc {"method": name, "args": [...]}` on a server started in dev mode).

Contract (other rollwise clients rely on these names):
- `rollwise_reload(path: str, version: int) -> None`: reload every weight from the safetensors folder `path`
  (HF names, whole checkpoint), re-pack a tied LM head, then record `version`.
- `rollwise_load_tensors(weights, version: int) -> None`: the same from an iterable of (HF name, tensor) pairs;
  only for an engine core in the caller's process (`rollwise.generate.vllm_inprocess`), where `collective_rpc`
  hands the worker its arguments by reference (a child process would be sent a pickled copy, or nothing).
- `rollwise_version() -> int | None`: the version of the weights loaded, None until a versioned reload
  succeeded (and again after a reload failed half-way).

What this cannot do: reset the prefix cache. The cache lives in the engine core's scheduler, not in the worker,
so the caller resets it after the RPC: `LLM.reset_prefix_cache()` in-process, `POST /reset_prefix_cache` on a
server. Until then, cached KV blocks computed by the old weights would be reused for matching prefixes.

Checked against vLLM 0.32.0 (`vllm/model_executor/model_loader/reload/`):
- `GPUModelRunner.reload_weights(weights_path=DIR)` (also the CPU runner's) re-reads every `*.safetensors`
  file of DIR (or takes `weights_iterator=` pairs) through the model's own `load_weights` and re-runs each layer's
  `process_weights_after_loading`, copying the result into the original storage.
- A reload that raises half-way leaves layers on the meta device with buffered tensors, which the next reload
  would replay: `_abandon_reload` restores them (the version stays unknown until a reload succeeds).
- A tied LM head (`lm_head.weight is embed_tokens.weight`) receives no checkpoint tensor, so its layer is
  never re-processed: on CPU its `cpu_linear` closure keeps the packed copy (oneDNN / sgl-kernel) of the
  *old* embedding, and logits silently come from stale weights. `_repack_tied_head` re-runs the head's
  `process_weights_after_loading` after the reload; on GPU that step is a no-op for unquantized weights.
"""

from __future__ import annotations

import torch


class RollwiseWorkerExtension:
    """Methods added to each vLLM worker (`self` is the worker; `self.model_runner` its model runner)."""

    _rollwise_version: int | None = None

    def rollwise_reload(self, path: str, version: int) -> None:
        """Reload all weights from the safetensors folder `path`, re-tie the LM head, adopt `version`."""
        self._rollwise_reload_from(version, weights_path=str(path))

    def rollwise_load_tensors(self, weights, version: int) -> None:
        """Load all weights from `weights` ((HF name, tensor) pairs) in place, re-tie the LM head, adopt `version`.

        The same layer-wise in-place reload as `rollwise_reload`, fed from the pairs instead of the files.
        """
        self._rollwise_reload_from(version, weights_iterator=weights)

    def _rollwise_reload_from(self, version: int, **source) -> None:
        self._rollwise_version = None  # unknown until the whole reload succeeded
        model = self.model_runner.get_model()
        try:
            self.model_runner.reload_weights(**source)
        except BaseException:
            _abandon_reload(model)
            raise
        _repack_tied_head(model)
        self._rollwise_version = int(version)

    def rollwise_version(self) -> int | None:
        """The version recorded by the last successful `rollwise_reload` (None before one)."""
        return self._rollwise_version

    def rollwise_lm_head_tied(self) -> bool:
        """Whether the LM head shares its weight with the input embedding (diagnostics for probes)."""
        head, embed = _head_and_embedding(self.model_runner.get_model())
        return head is not None and embed is not None and head.weight is embed.weight


def _head_and_embedding(model: torch.nn.Module):
    """(lm_head module or None, input embedding module or None) of a vLLM causal LM."""
    head = getattr(model, "lm_head", None)
    embed = None
    get_embed = getattr(model, "get_input_embeddings", None)
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "embed_tokens"):
        embed = inner.embed_tokens
    elif callable(get_embed):
        try:
            embed = get_embed()
        except (TypeError, NotImplementedError):  # some models take the ids as an argument
            embed = None
    if not isinstance(embed, torch.nn.Module):
        embed = None
    return head, embed


def _abandon_reload(model: torch.nn.Module) -> None:
    """After a reload that raised half-way (a tensor of the wrong shape, out of memory): put every layer still
    waiting for weights back on its own tensors and drop what it had buffered. vLLM 0.32's layer-wise reload
    does not do it, and the next reload would otherwise replay the buffered tensors (and fail again) or skip
    those layers. The weights are then part old, part new: the caller keeps the version unknown."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _place_kernel_tensors

    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            _place_kernel_tensors(layer, info)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


def _repack_tied_head(model: torch.nn.Module) -> None:
    """Make a tied LM head compute with the embedding just loaded.

    The head's Parameter is the embedding's (reload copies into the original storage, so the tie holds),
    but kernels that pre-pack the weight keep their own copy; re-running the head's quant method's
    `process_weights_after_loading` rebuilds it (on CPU: `dispatch_cpu_unquantized_gemm`).
    """
    head, embed = _head_and_embedding(model)
    if head is None or embed is None or not hasattr(head, "weight"):
        return
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False) or head.weight is embed.weight
    if not tied:
        return
    if head.weight is not embed.weight:  # a reload replaced the Parameter: tie it again
        head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        with torch.no_grad():
            method.process_weights_after_loading(head)
