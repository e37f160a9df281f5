"""Sharded training checkpoints on ``torch.distributed.checkpoint`` (DCP), optionally async.

With ``checkpoint_format: sharded`` every rank writes its own shards of the model and of the
optimizer state (``OUT/checkpoints/step-XXXXXXXX/sharded/``: DCP's ``.distcp`` files and
``.metadata``); nothing is gathered on one process. Rank 0 adds the small files of any
checkpoint: ``config.json`` (the model), ``trainer_state.pt`` (step, schedule, spike detector,
per-rank RNG and loader positions; no optimizer state, it is in the shards),
``train_config.yaml`` and the tokenizer.

**Atomic, also across processes.** The ranks write into one hidden temporary sibling
(``.step-XXXXXXXX.tmp-*``, created by rank 0, announced to all); after every rank's writes
are done (DCP's own collective end, then a barrier) rank 0 flushes and renames it into place.
A job killed before the rename (``kill -9`` included) leaves only the temporary directory,
which the next start removes, so a save in flight is never taken as complete and the previous
checkpoint is what resumes.

**Whole or damaged.** A checkpoint whose files were lost or cut off afterwards (a missing
``.distcp``, a short one, an unreadable or missing ``.metadata``) is found without reading a
tensor by :func:`diffattn.checkpoint.check_sharded_files`: every shard file ``.metadata``
names must be there and at least as long as the items it places in it. Resume (and
``--resume-fallback``, which skips such a checkpoint), a run directory as MODEL and
:func:`consolidate` check it first and name the file; a load that fails anyway is one
:class:`~diffattn.checkpoint.CheckpointError`, not DCP's traceback.

**Asynchronous** (``async_checkpoint: true``): the state is copied to CPU memory and the
writes run in a background thread (DCP's ``async_save``, over a separate gloo group so that
they never interleave with the training's collectives). Training continues; after each step
the ranks agree (one all-reduce of a flag) whether every rank's writes have finished, and then
the checkpoint is renamed into place. The next save, a stop (SIGTERM) and the end of the run
wait for a save in flight first.

**Resharding.** Loading reads the shards into whatever this launch's model holds (FSDP2 over
any number of ranks, FSDP2 × TP, or one process): DCP maps the saved pieces onto the new
layout by parameter name, and the optimizer state is keyed by parameter names too.
:func:`consolidate` writes the usual single model directory (safetensors, config, tokenizer)
in one process, for every command that loads models (``diffattn convert CHECKPOINT OUT``).
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffattn import fileio
from diffattn.checkpoint import SHARDED_DIRNAME, CheckpointError
from diffattn.train import distributed


def is_sharded(checkpoint: str | Path) -> bool:
    """Whether ``checkpoint`` is a sharded one (it has a ``sharded/`` directory; whether its
    files are whole is :func:`diffattn.checkpoint.check_sharded_files`'s question)."""
    return (Path(checkpoint) / SHARDED_DIRNAME).is_dir()


def _one_process() -> bool:
    """No process group: DCP reads and writes as a single process (``no_dist``)."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process even when told so (``no_dist``); it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """This rank's part of the model (and optimizer) state, keyed by parameter names."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    states = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        states["optim"] = get_optimizer_state_dict(model, optimizer)
    return states


def load_sharded(
    checkpoint: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """Read the shards of ``checkpoint`` into ``model`` (and ``optimizer``) as this launch
    lays them out (any world size or parallelism; see the module docstring). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    states = _states(model, optimizer)
    target = str(Path(checkpoint) / SHARDED_DIRNAME)
    try:
        with _quiet_single_process():
            dcp.load(states, checkpoint_id=target, no_dist=_one_process())
    except (Exception, CheckpointException) as error:  # DCP's is no Exception
        raise CheckpointError(f"{target}: the shards do not load ({_reason(error)})") from None
    set_model_state_dict(model, states["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, states["optim"])


def _reason(error: BaseException) -> str:
    """One line on why a DCP load failed: the first sentence of the first rank's own error,
    not DCP's traceback (nor torch's advice to load the file with ``weights_only=False``)."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))[0]
    first = " ".join(str(error).split()).split(". ")[0]
    return f"{type(error).__name__}: {first}"


@dataclass
class _InFlight:
    step: int
    tmp: Path
    final: Path
    future: Any
    finish: Callable[[Path], None]


class ShardedCheckpointer:
    """Writes sharded checkpoints into ``root`` (see the module docstring); one per run.

    ``save`` is collective. ``finish(path)`` runs on rank 0 after the rename (pruning, the
    ``latest``/``final`` links)."""

    def __init__(self, root: Path, asynchronous: bool = False) -> None:
        self.root = Path(root)
        self.asynchronous = asynchronous
        self.in_flight: _InFlight | None = None
        self._group = None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        write_small_files: Callable[[Path], None],
        finish: Callable[[Path], None],
    ) -> Path:
        """Write the checkpoint of ``step``; returns its final path (with ``asynchronous``,
        where it will appear once the writes finish). ``write_small_files(tmp)`` runs on
        rank 0 only."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        final = self.root / f"step-{step:08d}"
        tmp = Path(
            distributed.broadcast_object(
                str(fileio.temporary_sibling(final)) if distributed.is_main_rank() else None
            )
        )
        states = _states(model, optimizer)
        target = str(tmp / SHARDED_DIRNAME)
        if self.asynchronous:
            future = dcp.async_save(
                states, checkpoint_id=target, process_group=self._gloo(), no_dist=_one_process()
            )
        else:
            with _quiet_single_process():
                dcp.save(states, checkpoint_id=target, no_dist=_one_process())
            future = None
        if distributed.is_main_rank():
            write_small_files(tmp)
        self.in_flight = _InFlight(step, tmp, final, future, finish)
        if future is None:
            self._commit()
        return final

    def poll(self) -> None:
        """After a step: commit an asynchronous save once every rank's writes are done."""
        if self.in_flight is None:
            return
        pending = torch.tensor([0.0 if self.in_flight.future.done() else 1.0])
        if float(distributed.all_reduce_sum(pending)) == 0.0:
            self.wait()

    def wait(self) -> None:
        """Finish a save in flight (its writes, then the rename); a no-op when none is."""
        if self.in_flight is None:
            return
        if self.in_flight.future is not None:
            self.in_flight.future.result()
        self._commit()

    def abandon(self) -> None:
        """Drop a save in flight without renaming it (its writes are awaited, its files
        removed): what a failed step leaves."""
        if self.in_flight is None:
            return
        in_flight, self.in_flight = self.in_flight, None
        if in_flight.future is not None:
            in_flight.future.exception()
        if distributed.is_main_rank():
            shutil.rmtree(in_flight.tmp, ignore_errors=True)

    def _commit(self) -> None:
        in_flight, self.in_flight = self.in_flight, None
        distributed.barrier()  # every rank's shards are on disk
        failure = None
        if distributed.is_main_rank():
            try:
                fileio.commit_directory(in_flight.tmp, in_flight.final)
                in_flight.finish(in_flight.final)
            except Exception as error:  # every rank must learn about it
                failure = f"{type(error).__name__}: {error}"
        failure = distributed.broadcast_object(failure)
        if failure is not None:
            raise RuntimeError(f"saving the checkpoint of step {in_flight.step} failed: {failure}")

    def _gloo(self):
        """A gloo group for the background writes' collectives (None in one process)."""
        if not distributed.active():
            return None
        if self._group is None:
            self._group = torch.distributed.new_group(backend="gloo")
        return self._group


def consolidate(
    checkpoint: str | Path,
    out: str | Path,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the sharded ``checkpoint`` as a single model directory ``out`` (safetensors,
    ``config.json``, tokenizer, ``train_config.yaml``) in this one process, atomically;
    ``dtype`` casts the weights."""
    from diffattn.checkpoint import check_sharded_files, read_config, write_model_files
    from diffattn.model import DiffTransformerLM
    from diffattn.train.checkpoint import CONFIG_YAML_NAME

    checkpoint = Path(checkpoint)
    if not is_sharded(checkpoint):
        raise CheckpointError(f"{checkpoint}: not a sharded checkpoint (no {SHARDED_DIRNAME}/)")
    check_sharded_files(checkpoint)  # a missing or cut-off file is named before any work
    config = read_config(checkpoint)
    with torch.device("meta"):
        model = DiffTransformerLM(config)
    model.to_empty(device="cpu")
    model.rotary.reset_parameters()
    load_sharded(checkpoint, model, None)
    if dtype is not None:
        model.to(dtype=dtype)
    with fileio.atomic_directory(out, overwrite=overwrite) as tmp:
        write_model_files(model, tmp)
        fileio.copy_tokenizer_files(checkpoint, tmp)
        if (checkpoint / CONFIG_YAML_NAME).is_file():
            shutil.copyfile(checkpoint / CONFIG_YAML_NAME, tmp / CONFIG_YAML_NAME)
    return Path(out)
