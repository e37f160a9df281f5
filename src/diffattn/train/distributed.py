"""The launch environment and the few collectives the trainer needs.

:func:`read_env` is the one place that reads torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); everything else gets a
:class:`DistEnv`. A plain ``python -m diffattn.train`` is rank 0 of a world of 1. Under
torchrun (one node or many, through its rendezvous) the process group is created from those
variables with NCCL on CUDA and gloo on CPU. Every helper here is a no-op in a single process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launched: bool = False
    """True when started by torchrun (or anything that sets its variables)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that logs and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.launched


def read_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """The :class:`DistEnv` described by torchrun's environment variables."""
    environ = os.environ if environ is None else environ
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        return DistEnv()
    missing = [name for name in TORCHRUN_VARIABLES if name not in environ]
    if missing:
        raise ValueError(
            f"incomplete distributed environment: {', '.join(missing)} not set "
            "(launch with torchrun)"
        )
    try:
        rank = int(environ["RANK"])
        world = int(environ["WORLD_SIZE"])
        local_rank = int(environ["LOCAL_RANK"])
        local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError as error:
        raise ValueError(f"malformed distributed environment variable ({error})") from None
    if not 0 <= rank < world or not 0 <= local_rank < local_world:
        raise ValueError(f"RANK={rank}, LOCAL_RANK={local_rank} do not fit WORLD_SIZE={world}")
    return DistEnv(rank, world, local_rank, local_world, launched=True)


def resolve_device(requested: str, env: DistEnv) -> torch.device:
    """``auto`` → CUDA when available; under torchrun each process takes ``cuda:LOCAL_RANK``."""
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    return torch.device("cuda", env.local_rank if env.launched else torch.cuda.current_device())


def init_process_group(env: DistEnv, device: torch.device) -> bool:
    """Join the process group (NCCL on CUDA, gloo on CPU); True if this call created it."""
    if not env.launched or dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart != "0":
        # torchrun keeps one store across restarts (--max-restarts): without a prefix per
        # attempt, a restarted group can read the addresses of the processes it replaced.
        # The first attempt keeps torch's own initialisation.
        store, rank, world = next(dist.rendezvous("env://"))
        kwargs.update(
            store=dist.PrefixStore(f"diffattn/attempt-{restart}/", store),
            rank=rank,
            world_size=world,
        )
    dist.init_process_group(backend=backend, **kwargs)
    return True


def shutdown() -> None:
    """Leave the process group if one exists."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_main_rank() -> bool:
    """True on rank 0 of the process group, and in a single process."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def barrier() -> None:
    if active():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place (a no-op in one process)."""
    if active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    if active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank."""
    if not active():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def gather_objects(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` as a list on rank 0 (``None`` elsewhere)."""
    if not active():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out
