"""The launch environment and the few collectives the trainer needs.

:func:`read_env` is the one place that reads torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); everything else gets a
:class:`DistEnv`. A plain ``python -m diffattn.train`` is rank 0 of a world of 1. Under
torchrun (one node or many, through its rendezvous) the process group is created from those
variables with NCCL on CUDA and gloo on CPU. Every helper here is a no-op in a single process.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

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


def shutdown(*, wait: bool = True) -> bool:
    """Leave the process group (if one exists); see :func:`exit_process` for why and how.

    With ``wait`` (the run ended normally on every rank, and every rank calls this): wait for
    every rank (a barrier, so no peer is still inside a collective), destroy the groups, drop
    torch's DTensor caches that refer to them and collect garbage, so that a group nothing
    else holds is freed and its worker threads are joined now. Without ``wait`` (this rank is
    failing and its peers may be blocked in another collective): destroy the groups only;
    nothing here waits for a peer.

    Returns:
        True when no process group of this process is alive any more (always True in a
        single process); False when one still is (without ``wait``, or when something holds
        it: a DDP/FSDP2 model of the caller, or torch itself, see :func:`exit_process`).
    """
    global _lingering
    if not (dist.is_available() and dist.is_initialized()):
        return not _lingering
    groups = [weakref.ref(group) for group in _all_groups()]
    if wait:
        _let_communication_threads_finish()  # the barrier then keeps no earlier work alive
        barrier()
        _let_communication_threads_finish()
    dist.destroy_process_group()
    if wait:
        _clear_dtensor_caches()
        gc.collect()
    _lingering = not wait or any(ref() is not None for ref in groups)
    return not _lingering


_lingering = False
"""A destroyed process group is still alive (its backend's worker threads may run)."""

SETTLE_SECONDS = 0.25
"""How long :func:`shutdown` leaves the GIL free after its barrier (see
:func:`_let_communication_threads_finish`)."""


def _let_communication_threads_finish() -> None:
    """Leave the GIL free for a moment, so that the backend's worker threads finish releasing
    the collectives that just completed.

    A gloo worker thread (``pt_gloo_runloop``) releases a work after the caller's ``wait``
    has returned; a work that holds tensors made in Python (a broadcast, or the barrier that
    keeps every earlier pending work) takes the GIL to drop their Python objects. If the
    process group is destroyed first (``destroy_process_group``, or the garbage collection of a
    DDP model whose reducer holds the group's last reference), its destructor joins that
    thread while the main thread holds the GIL, and both wait for ever: seen on a loaded
    2-core machine as a DDP run that never ended, the main thread in
    ``ProcessGroupGloo::~ProcessGroupGloo`` → ``std::thread::join`` and the worker in
    ``AsyncBarrierWork::~AsyncBarrierWork`` → ``TensorImpl::decref_pyobject`` → take the GIL.
    Sleeping in slices gives the scheduler several chances to run that thread. Done before the
    barrier too: a barrier holds every work still in progress when it is queued, so a work
    released late would otherwise be released again with the barrier's."""
    slices = 5
    for _ in range(slices):
        time.sleep(SETTLE_SECONDS / slices)


def exit_process(code: int) -> NoReturn:
    """End the process with exit status ``code`` without racing a communication thread.

    ``destroy_process_group`` unregisters a group but frees it only when nothing refers to it
    any more, and with torch 2.13 something always does after an FSDP2 run: creating a
    ``DeviceMesh`` leaves references to the default group in torch's C++ registries that no
    public call releases. The group's backend then keeps its worker threads (gloo:
    ``pt_gloo_runloop``, ``gloo_tcp_loop``) until the process ends. When such a thread
    finishes a collective and has to take the GIL (to run or drop a Python completion
    callback) after the interpreter has begun to finalize, Python ends the thread with
    ``pthread_exit``; the forced unwind meets a C++ ``noexcept`` frame and the process aborts
    with "terminate called without an active exception" (SIGABRT), after a run that
    succeeded. On a loaded machine the thread can lag the main thread long enough for this.

    So while a process group lives (never destroyed, or left alive by :func:`shutdown`), this
    flushes the standard streams and the ``logging`` handlers and leaves with
    ``os._exit(code)``: nothing of the interpreter is torn down while those threads run (the
    files the run wrote are closed before this). Otherwise it raises ``SystemExit(code)`` as
    ``sys.exit`` does.
    """
    if not (_lingering or (dist.is_available() and dist.is_initialized())):
        raise SystemExit(code)
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _all_groups() -> list[Any]:
    """Every process group of this process (the default one and those created later)."""
    from torch.distributed import distributed_c10d

    groups = list(getattr(distributed_c10d._world, "pg_map", {}))
    default = distributed_c10d._get_default_group()
    return groups if default in groups else [default, *groups]


def _clear_dtensor_caches() -> None:
    """Empty torch's DTensor caches, which hold the ``DeviceMesh`` objects (and through them
    the process groups) of the shardings they have seen. Each is looked up by name and
    skipped when this torch version does not have it."""
    import importlib

    for module_name, path in DTENSOR_CACHES:
        try:
            target: Any = importlib.import_module(module_name)
            for name in path:
                target = getattr(target, name)
        except (ImportError, AttributeError):
            continue
        target()


DTENSOR_CACHES = (
    # sharding propagation: the Python LRU cache and the C++ fast path
    ("torch.distributed.tensor.debug", ("_clear_sharding_prop_cache",)),
    (
        "torch.distributed.tensor._sharding_prop",
        ("ShardingPropagator", "_propagate_tensor_meta_cached", "cache_clear"),
    ),
    # redistribution planners and transform plans, keyed by mesh
    ("torch.distributed.tensor._redistribute", ("clear_redistribute_planner_cache",)),
    ("torch.distributed.tensor._redistribute", ("_gen_transform_infos", "cache_clear")),
    # mesh topology of the collective cost model
    (
        "torch.distributed.tensor._collective_utils",
        ("MeshTopoInfo", "build_from_mesh", "cache_clear"),
    ),
)
"""(module, attribute path) of each DTensor cache-clearing callable."""


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
