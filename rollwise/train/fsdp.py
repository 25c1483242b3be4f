"""The FSDP2 trainer backend (`train.backend = "fsdp2"`, `train.world_size = N`): the local objective, data parallel.

Parameters are sharded with PyTorch FSDP2 (`fully_shard` on every decoder layer, then on a root module that
holds the embeddings, final norm and LM head, tied or not) over a 1-D DeviceMesh of N ranks: gloo on CPU, NCCL
on CUDA; with bf16 (`train.precision`), `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`.

Same objective as `Trainer` (Zhao et al. 2023, "PyTorch FSDP"; the data-parallel split is plain gradient
accumulation): every rank plans each minibatch into the same micro-batches and takes the normalisers from the
whole minibatch; rank r runs micro-batches r, r+N, ... and pads with zero-weight stand-ins so every rank issues
the same collectives. FSDP's reduce-scatter sums (divide factor 1), so the gradient is the local trainer's sum
over micro-batches; the gradient norm is the global one; metrics are merged over ranks.

Rank 0 is the driver and exposes the `Trainer` API; ranks 1..N-1 follow its commands (`rollwise.train.distributed`).
"""

from __future__ import annotations

import atexit
import math
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rollwise.train import distributed as ranks
from rollwise.train.batching import MicroBatch, collate
from rollwise.train.logprobs import response_hidden, token_logprobs
from rollwise.train.trainer import NonFiniteError, Trainer, _Accumulator, use_bf16

SHARDS_DIR = "trainer_shards"  # the checkpoint's sharded trainer state (torch.distributed.checkpoint)
_ROOT_PREFIX = "policy."


class PolicyRoot(torch.nn.Module):
    """FSDP2's root module around the HF policy: every pass over the policy is one call of this module, so the
    root's parameters (embeddings, final norm, LM head) are gathered and its gradients reduced, whichever part
    of the HF model the pass uses (`token_logprobs` calls the decoder and reads the head's weight)."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, fn, *args, **kwargs):
        """`fn(policy, *args, **kwargs)` inside the root's forward."""
        return fn(self.policy, *args, **kwargs)


def shard_policy(model: torch.nn.Module, world_size: int, device_type: str, bf16: bool) -> PolicyRoot:
    """`fully_shard` every decoder layer of `model`, then a `PolicyRoot` around it, over a (world_size,) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    root = PolicyRoot(model)
    fully_shard(root, mesh=mesh, mp_policy=mp)
    for module in root.modules():  # sum over ranks, not FSDP's mean: the gradient is a sum over micro-batches
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return root


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _broadcast_module(module: torch.nn.Module) -> None:
    """Copy rank 0's parameters and buffers into every rank's `module` (in place)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


class FSDPTrainer(Trainer):
    """`Trainer` over N FSDP2 ranks. Rank 0 (the driver) calls `step`, `skip_step`, `kl_penalties`,
    `policy_state`, `probe_logprobs`, `write_checkpoint`, `load_state_dict`, `close`; workers run `run_command`.

    The process group must exist (`build_trainer` or `rollwise.train.launch.worker_main` set it up).
    `model` is this rank's copy of the policy (rank 0's weights are broadcast to all); `ref_model` stays
    unsharded on each rank, so `kl_penalties` needs rank 0 alone.
    """

    def __init__(self, model, train_cfg, algo_cfg, pad_id: int, ref_model=None, temperature: float = 1.0,
                 max_new_tokens: int = 64, *, rank: int, world_size: int, workers: ranks.Workers | None = None):
        self.rank, self.world_size = rank, world_size
        self.workers = workers
        self.closers: list = []  # run after the ranks are stopped by `close` (e.g. Ray actors' bundles freed)
        self.closed, self._broken = False, False
        device_type = next(model.parameters()).device.type
        _broadcast_module(model)
        self.root = shard_policy(model, world_size, device_type, use_bf16(train_cfg.precision, device_type))
        super().__init__(model, train_cfg, algo_cfg, pad_id, ref_model=ref_model, temperature=temperature,
                         max_new_tokens=max_new_tokens)
        holder = {"policy": self.root}
        if self.value_head is not None:  # replicated (one linear layer): same start everywhere, grads summed
            _broadcast_module(self.value_head)
            holder["value_head"] = self.value_head
        self._holder = torch.nn.ModuleDict(holder)  # names every optimizer parameter (checkpoint shards)
        if rank == 0:
            atexit.register(self.close)

    # ------------------------------------------------------------------ the driver's API (rank 0)

    def step(self, samples, version: int | None = None, terms=None) -> dict[str, float]:
        return self._command(("step", samples, version, terms))

    def skip_step(self) -> None:
        self._command(("skip_step",))

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The full, unsharded policy weights under HF names, on CPU (rank 0; every rank takes part)."""
        return self._command(("state_dict",))

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs at temperature 1 of token_ids[1:] by the sharded policy (a forward on every rank)."""
        return self._command(("probe", list(token_ids)))

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """The HF model of a checkpoint holds the gathered full weights (rank 0)."""
        return self.policy_state()

    def write_checkpoint(self, directory: Path) -> None:
        """The sharded optimizer state (`torch.distributed.checkpoint`), written by every rank into
        `directory/SHARDS_DIR`."""
        self._command(("save", str(Path(directory) / SHARDS_DIR)))

    def state_dict(self) -> dict[str, Any]:
        """The replicated part of the trainer state; the optimizer's is in the checkpoint's shards."""
        return {"optimizer": None, "fsdp": {"world_size": self.world_size}, **self._replicated_state()}

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path) -> None:
        """Every rank loads its optimizer shard from `checkpoint/SHARDS_DIR`, and the replicated rest. ValueError
        (one line) for a checkpoint of the local backend or of another number of ranks."""
        saved, name = state.get("fsdp"), f"checkpoint step-{state.get('step')}"
        if saved is None:
            raise ValueError(f"{name} was written by train.backend = 'local'; resume it with train.backend = "
                             "'local' (its optimizer state is not sharded)")
        if saved["world_size"] != self.world_size:
            raise ValueError(f"{name} holds optimizer state sharded over {saved['world_size']} ranks, this run has "
                             f"{self.world_size}; resume with train.world_size = {saved['world_size']}")
        extra = {key: state.get(key) for key in ("scheduler", "updates", "nonfinite_streak", "value_head", "step")}
        self._command(("load", str(Path(checkpoint) / SHARDS_DIR), extra))

    def close(self) -> None:
        """Rank 0: the workers exit (killed if they do not within 10 s), the process group goes. Idempotent."""
        if self.rank != 0 or self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        try:
            if not self._broken:
                ranks.send_command(("close",))
        except Exception:
            self._broken = True
        finally:
            try:
                if self.workers is not None:
                    self.workers.stop(grace_s=0.0 if self._broken else 10.0)
                if dist.is_initialized():
                    dist.destroy_process_group()
            finally:
                for close in self.closers:
                    close()

    def _command(self, command: tuple):
        if self.closed:
            raise RuntimeError(f"trainer ranks are closed; cannot run {command[0]!r}")
        with self._guard(command[0]):
            ranks.send_command(command)
            return self.run_command(command)

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """A failed command breaks the group; a failed collective is reported as the rank that caused it."""
        try:
            yield
        except BaseException as exc:
            self._broken = True
            report = None
            if self.workers is not None:
                report = self.workers.failure(wait_s=5.0 if ranks.looks_like_comm_error(exc) else 0.0)
            if report is None and ranks.looks_like_comm_error(exc):
                report = (f"trainer ranks: {what!r} failed in a collective ({type(exc).__name__}: "
                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); a rank died or hung")
            if report is None:
                raise
            self._print_worker_tracebacks()
            raise RuntimeError(report) from exc

    def _print_worker_tracebacks(self) -> None:
        for rank in range(1, self.world_size):
            text = self.workers.traceback_of(rank) if self.workers is not None else None
            if text:
                sys.stderr.write(f"rollwise: traceback of trainer rank {rank}:\n{text}")
        sys.stderr.flush()

    # ------------------------------------------------------------------ every rank

    def run_command(self, command: tuple):
        """Execute one command on this rank (rank 0 after broadcasting it, workers after receiving it)."""
        name, *args = command
        if name == "step":
            return Trainer.step(self, *args)
        if name == "skip_step":
            return Trainer.skip_step(self)
        if name == "state_dict":
            return self._full_state_dict()
        if name == "probe":
            return self._probe(*args)
        if name == "save":
            return self._save(*args)
        if name == "load":
            return self._load(*args)
        raise ValueError(f"unknown trainer command {name!r}")

    def _full_state_dict(self) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        return {name.removeprefix(_ROOT_PREFIX): tensor for name, tensor in state.items()}

    def _probe(self, token_ids: list[int]) -> list[float]:
        from rollwise.models.probe import model_probe_logprobs

        with torch.no_grad():
            return self.root(model_probe_logprobs, token_ids)

    def _optimizer_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {"optimizer": get_optimizer_state_dict(self._holder, self.optimizer)}

    def _save(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._optimizer_state(), checkpoint_id=directory)

    def _load(self, directory: str, extra: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        state = self._optimizer_state()
        dcp.load(state, checkpoint_id=directory)
        set_optimizer_state_dict(self._holder, self.optimizer, state["optimizer"])
        self._load_replicated(extra)

    # ------------------------------------------------------------------ the Trainer hooks

    def _logprobs(self, model, mb: MicroBatch, with_entropy: bool = True, hidden_out: list | None = None):
        if model is not self.model:  # the frozen reference: unsharded, local
            return super()._logprobs(model, mb, with_entropy=with_entropy, hidden_out=hidden_out)
        return self.root(token_logprobs, mb, self.temperature, with_entropy=with_entropy, hidden_out=hidden_out)

    def _hidden(self, mb: MicroBatch) -> torch.Tensor:
        return self.root(response_hidden, mb)

    def _share(self, plan: list[MicroBatch]) -> list[tuple[int, MicroBatch]]:
        """Micro-batches rank, rank + N, ... of `plan`, padded to ceil(M / N) with one-sample stand-ins (-1)."""
        mine = [(j, plan[j]) for j in range(self.rank, len(plan), self.world_size)]
        rounds = math.ceil(len(plan) / self.world_size)
        if len(mine) < rounds:
            stand_in = collate(plan[0].samples[:1], self.pad_id, share_prompt=self.cfg.share_prompt)
            mine += [(-1, stand_in)] * (rounds - len(mine))
        return mine

    def _merged(self, acc: _Accumulator) -> _Accumulator:
        """Sums and weights of every rank's metrics added up (weight-0 entries: the maximum over ranks)."""
        acc.materialize()
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (acc.sums, acc.weights, acc.maxima))
        out = _Accumulator()
        for sums, weights, maxima in gathered:
            for key, value in sums.items():
                if key in maxima:
                    out.keep_max(key, value)
                else:
                    out.sums[key] = out.sums.get(key, 0.0) + value
                    out.weights[key] = out.weights.get(key, 0.0) + weights[key]
        return out

    def _optimizer_step(self, acc: _Accumulator) -> bool:
        """As `Trainer._optimizer_step`, over ranks: the value head's gradients summed, the norm the global one
        (sharded gradients' norm `full_tensor()`-ed), a NaN/Inf loss on any rank skips the step on all."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        sharded = [p for p in params if isinstance(p, DTensor)]
        plain = [p for p in params if not isinstance(p, DTensor) and p.grad is not None]
        if plain:
            flat = torch.cat([p.grad.reshape(-1) for p in plain])
            dist.all_reduce(flat)
            for p, part in zip(plain, flat.split([p.grad.numel() for p in plain])):
                p.grad.copy_(part.view_as(p.grad))
        nonfinite = torch.tensor([float(self._nonfinite_loss)], device=self.device)  # NCCL: a CUDA tensor
        dist.all_reduce(nonfinite, op=dist.ReduceOp.MAX)
        norms = []
        grads = [p.grad for p in sharded if p.grad is not None]
        if grads:
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if plain:
            norms.append(torch.nn.utils.get_total_norm([p.grad for p in plain], 2.0))
        total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
        torch.nn.utils.clip_grads_with_norm_(sharded, self.cfg.max_grad_norm, total)
        if plain:
            torch.nn.utils.clip_grads_with_norm_(plain, self.cfg.max_grad_norm, total)
        return self._apply_if_finite(acc, float(total), bool(nonfinite.item()))

    def _check_finite_weights(self, where: str) -> None:
        """NonFiniteError on every rank, naming the first parameter whose shard on any rank holds NaN/Inf."""
        bad = next((name for name, p in self.model.named_parameters()
                    if not bool(torch.isfinite(_local(p.detach())).all())), "")
        flag = torch.tensor([1.0 if bad else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            names: list[Any] = [None] * self.world_size
            dist.all_gather_object(names, bad)
            first = next(n for n in names if n)
            raise NonFiniteError(f"parameter {first} holds NaN/Inf {where}; lower train.lr or check the loss")
