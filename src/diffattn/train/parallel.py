"""Building the model for a run: activation checkpointing, compile, DDP or FSDP2.

Activation checkpointing (full, every k-th block, or per operator) is
:mod:`diffattn.train.activation_checkpointing`.

Every model goes through :func:`build_model`, which applies, per decoder block, activation
checkpointing and ``torch.compile`` and then :func:`parallelize`:

* ``none`` / ``ddp``: the model is built on CPU with the run's seed (so the initial weights do
  not depend on device or launch), moved to the device, and wrapped in
  ``DistributedDataParallel`` for ``ddp``.
* ``fsdp``: the model is built on the meta device, each block (:func:`decoder_blocks`) is
  sharded with ``fully_shard`` and then the root, the shards are allocated with
  ``to_empty``, and ``init_weights()`` fills parameters *and* buffers (RoPE). With
  ``fsdp_init: rank0`` rank 0 also builds the full model on CPU with the seed and broadcasts
  it, so the initial weights equal a single-process run's; with ``sharded`` no full copy is
  made. The optimizer is built only after this.

State dicts are exchanged in the full, unsharded form keyed by parameter names
(``torch.distributed.checkpoint.state_dict``), so a checkpoint is independent of the launch: a
run saved under FSDP2 on 8 ranks resumes in one process, and the other way round.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from diffattn.config import ModelConfig
from diffattn.model import DiffTransformerLM, let_dynamo_skip_kernel_logs
from diffattn.train import distributed
from diffattn.train.activation_checkpointing import apply_activation_checkpointing


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper, or ``model`` itself (FSDP2 shards in place)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of ``model``: its first non-empty ``nn.ModuleList`` in module order
    (``model.layers`` of a :class:`DiffTransformerLM`, ``model.model.layers`` of a Hugging
    Face ``*ForCausalLM``, ``base_model.model.model.layers`` of a PEFT model).

    Raises:
        ValueError: ``model`` holds no such list.
    """
    for module in unwrap(model).modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return module
    raise ValueError(
        f"{type(model).__name__} has no nn.ModuleList of decoder blocks (such as model.layers)"
    )


def apply_compile(model: nn.Module) -> None:
    """``torch.compile`` each decoder block in place (names unchanged): ours through
    :meth:`~diffattn.model.DiffTransformerLM.compile_blocks`, any other model's blocks
    (:func:`decoder_blocks`) with ``torch.compile``'s defaults."""
    inner = unwrap(model)
    if isinstance(inner, DiffTransformerLM):
        inner.compile_blocks()
        return
    let_dynamo_skip_kernel_logs()
    for block in decoder_blocks(model):
        block.compile()


def parallelize(
    model: nn.Module,
    mode: str,
    device: torch.device | None = None,
    mesh=None,
    mixed_precision: torch.dtype | None = None,
) -> nn.Module:
    """Wrap ``model`` for data parallelism: ``none``, ``ddp`` or ``fsdp`` (FSDP2).

    ``ddp`` expects the model on ``device``; ``fsdp`` shards each block of
    :func:`decoder_blocks` and then the root (the model may still be on the meta device; see
    :func:`build_model`) over ``mesh`` (default: every rank; the ``dp_shard`` dimension of a
    2-D mesh when the model is also tensor-parallel). ``mixed_precision`` (``fsdp`` only):
    the dtype parameters are all-gathered and computed in, gradients reduced in fp32, the
    sharded master weights and the optimizer state staying fp32 (FSDP2's
    ``MixedPrecisionPolicy``).
    """
    if mode == "none":
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device is not None and device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        device_type = device.type if device is not None else "cpu"
        if mesh is None:
            mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
        policy = MixedPrecisionPolicy(
            param_dtype=mixed_precision, reduce_dtype=torch.float32 if mixed_precision else None
        )
        for block in decoder_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model
    raise ValueError(f"unknown parallel mode {mode!r}; choose none, ddp or fsdp")


def build_model(
    config: ModelConfig,
    *,
    mode: str,
    device: torch.device,
    seed: int,
    fsdp_init: str = "rank0",
    activation_checkpointing: str | bool = "none",
    selective_ac: str | int = "op",
    compile: bool = False,
    mixed_precision: torch.dtype | None = None,
    initial_state: dict[str, torch.Tensor] | None = None,
    load_initial_state: bool = False,
    tp: int = 1,
) -> nn.Module:
    """The model of a run, initialised and parallelised (see the module docstring).

    With ``load_initial_state`` (the same on every rank), the full state dict
    ``initial_state`` held by rank 0 replaces the seeded initialisation, e.g. when resuming.
    ``tp > 1`` first splits the model over groups of ``tp`` ranks
    (:mod:`diffattn.train.tensor_parallel`), then FSDP2 shards it over the groups.
    """
    dp_mesh = None
    if tp > 1:
        from diffattn.train.tensor_parallel import device_meshes

        dp_mesh, tp_mesh = device_meshes(device.type, torch.distributed.get_world_size(), tp)
    if mode == "fsdp":
        with torch.device("meta"):
            model = DiffTransformerLM(config)
    else:
        torch.manual_seed(seed)
        model = DiffTransformerLM(config)  # built on CPU: the same weights on every device
        if load_initial_state and initial_state is not None:
            model.load_state_dict(initial_state, strict=True)  # DDP broadcasts rank 0's
        model.to(device)
    if tp > 1:
        from diffattn.train.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, tp_mesh)
    if activation_checkpointing not in (False, "none"):
        mode_ac = "full" if activation_checkpointing is True else activation_checkpointing
        apply_activation_checkpointing(decoder_blocks(model), mode_ac, selective_ac)
    if compile:
        apply_compile(model)
    wrapped = parallelize(model, mode, device, dp_mesh, mixed_precision)
    if tp > 1 and mode != "fsdp" and load_initial_state:
        load_full_model_state(wrapped, initial_state)  # into the shards, from rank 0
    if mode == "fsdp":
        model.to_empty(device=device)
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            if load_initial_state or fsdp_init == "rank0":  # the random values are replaced
                warnings.filterwarnings("ignore", message="DTensor random operators")
            model.init_weights()  # parameters (per shard) and buffers (RoPE)
        if load_initial_state:
            load_full_model_state(wrapped, initial_state)
        elif fsdp_init == "rank0":
            main = distributed.is_main_rank()
            load_full_model_state(wrapped, _seeded_full_state(config, seed) if main else None)
    return wrapped


def _seeded_full_state(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return DiffTransformerLM(config).state_dict()


# ----------------------------------------------------------------------------------------
# full state dicts
def _options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full model state dict on CPU on rank 0 (``None`` on other ranks). Collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_options(cpu_offload=True))
    return state if distributed.is_main_rank() else None


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor] | None) -> None:
    """Load a full state dict held by rank 0 into every rank's (possibly sharded) model."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    if distributed.active():
        set_model_state_dict(model, state or {}, options=_options(broadcast_from_rank0=True))
    else:
        set_model_state_dict(model, state, options=_options())


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
    """The optimizer state keyed by parameter names, full and on CPU, on rank 0. Collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    return state if distributed.is_main_rank() else None


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict | None
) -> None:
    """Load a full optimizer state held by rank 0 on every rank."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if distributed.active():
        set_optimizer_state_dict(
            model, optimizer, state or {}, options=_options(broadcast_from_rank0=True)
        )
    else:
        set_optimizer_state_dict(model, optimizer, state, options=_options())


# ----------------------------------------------------------------------------------------
# gradient accumulation
@contextlib.contextmanager
def gradient_sync(model: nn.Module, mode: str, sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce of DDP / reduce-scatter of FSDP2 unless ``sync``."""
    if mode == "ddp" and not sync:
        with model.no_sync():
            yield
    elif mode == "fsdp":
        model.set_requires_gradient_sync(sync)
        yield
    else:
        yield
