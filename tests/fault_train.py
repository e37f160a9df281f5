"""``python tests/fault_train.py ARGS``: ``python -m diffattn.train ARGS`` with a fault injected.

A test helper, not part of the library. Under ``torchrun`` one rank kills itself with SIGKILL,
once: the first process to reach the fault writes the marker file ``FAULT_MARKER`` and dies;
a restarted group finds the marker and trains on. Environment:

* ``FAULT_MARKER``: path of the marker file (no fault without it);
* ``FAULT_RANK``: the rank that dies (default 0);
* ``FAULT_STEP``: the step at which it dies;
* ``FAULT_AT``: ``after-step`` (default): after the optimizer step ``FAULT_STEP``, from a step
  callback; ``mid-save``: while writing the checkpoint of ``FAULT_STEP``, after the weights
  are in the temporary directory and before it is renamed (rank 0 writes checkpoints);
  ``in-flight``: a sharded checkpoint of ``FAULT_STEP`` is about to be renamed into place
  (its shards written, asynchronously or not) when the rank dies;
* ``FAULT_RESUME_IF_CHECKPOINTED=1``: add ``--resume`` only when ``--out`` already holds a
  checkpoint, which is what a launcher script must decide while ``--resume`` refuses an
  output directory without checkpoints.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _fault_due(step: int) -> bool:
    marker = os.environ.get("FAULT_MARKER")
    if not marker or Path(marker).exists():
        return False
    if _rank() != int(os.environ.get("FAULT_RANK", "0")):
        return False
    return step == int(os.environ["FAULT_STEP"])


def _die(step: int) -> None:
    Path(os.environ["FAULT_MARKER"]).write_text(f"rank {_rank()} killed at step {step}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _install_after_step() -> None:
    import diffattn.train as train_package

    original = train_package.train

    def kill_after_step(state) -> None:
        if _fault_due(state.step):
            _die(state.step)

    @functools.wraps(original)
    def train(*args, callbacks=(), **kwargs):
        return original(*args, callbacks=[*callbacks, kill_after_step], **kwargs)

    train_package.train = train


def _install_mid_save() -> None:
    from diffattn.train import checkpoint

    original = checkpoint.write_model_files

    @functools.wraps(original)
    def write_model_files(model, directory, *args, **kwargs):
        result = original(model, directory, *args, **kwargs)
        name = Path(directory).name  # .step-XXXXXXXX.tmp-*
        step = int(name[len(".step-") :].split(".", 1)[0]) if name.startswith(".step-") else -1
        if _fault_due(step):
            _die(step)
        return result

    checkpoint.write_model_files = write_model_files


def _install_in_flight() -> None:
    from diffattn.train import sharded

    original = sharded.ShardedCheckpointer._commit

    @functools.wraps(original)
    def _commit(self):
        if self.in_flight is not None and _fault_due(self.in_flight.step):
            _die(self.in_flight.step)
        return original(self)

    sharded.ShardedCheckpointer._commit = _commit


def _argv(argv: list[str]) -> list[str]:
    if os.environ.get("FAULT_RESUME_IF_CHECKPOINTED") != "1" or "--resume" in argv:
        return argv
    from diffattn.train.checkpoint import CHECKPOINTS_DIRNAME, list_checkpoints

    out = Path(argv[argv.index("--out") + 1])
    return [*argv, "--resume"] if list_checkpoints(out / CHECKPOINTS_DIRNAME) else argv


def main(argv: list[str]) -> int:
    where = os.environ.get("FAULT_AT", "after-step")
    if where == "mid-save":
        _install_mid_save()
    elif where == "in-flight":
        _install_in_flight()
    else:
        _install_after_step()
    from diffattn.train.cli import main as train_main

    return train_main(_argv(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
