"""The training loop: :class:`Trainer` runs a :class:`TrainConfig`, returns a :class:`TrainResult`.

``train(config, out)`` is ``Trainer(config, out).run()``. The trainer's parts, in the order
``run`` uses them:

* :meth:`Trainer.build`: launch (torchrun environment, process group, resume plan), data,
  model (a preset or ``model_factory()``, parallelised with DDP or FSDP2), optimizer and
  schedule, data loader, resume state, validation batches, output directory and logger.
* :meth:`Trainer.train_step`: one optimizer step. Set the learning rate for the step; take
  the rank's share of the global batch (``global_batch_size / world`` sequences of
  ``seq_len`` tokens) and run :meth:`Trainer.forward_backward_step` on it: micro batches of
  ``micro_batch_size`` with bf16 autocast on CUDA, each micro loss weighted by its share of
  the global batch's targets (:mod:`~diffattn.train.targets`), gradients synchronised only on
  the last one. Then clip the global gradient norm; agree over
  ranks on the mean loss and on stop requests; stop if the loss or the gradient norm is not
  finite (weights untouched); take the AdamW step; call the step callbacks.
* :meth:`Trainer.evaluate`: the mean validation loss, and per-token losses on request, over
  ``eval_batches × eval_batch_size`` windows spread evenly over the whole validation stream
  (:func:`~diffattn.data.loader.spread_windows`), so every source of a data mix counts in
  proportion to its held-out tokens.
* :meth:`Trainer.save`: a checkpoint of the current step.

``run`` logs, evaluates and checkpoints as configured after each step. Only rank 0 logs and
writes.

Exactness: the initial weights depend only on the seed (built on CPU, or broadcast from rank
0 under FSDP2), the data order only on the seed and the step, and a checkpoint holds
everything else (optimizer, schedule, RNG states, loader position, spike detector), so a
resumed run repeats the losses of an uninterrupted one on CPU.

Any model: ``train(config, out, model_factory=make)`` trains the ``nn.Module`` that ``make()``
returns instead of the preset of ``config.model``, through the same path: one process, DDP or
FSDP2 (FSDP2 shards the decoder blocks: the first ``nn.ModuleList`` of the model, e.g.
``model.layers`` or a Hugging Face model's ``model.model.layers``). Its ``forward(input_ids,
labels=input_ids)`` must return an object with ``.loss`` (a :class:`~diffattn.DiffTransformerLM`
and Hugging Face causal LMs both shift the labels inside; per-token validation losses also
need ``.logits``). Only parameters with ``requires_grad`` reach the optimizer, so a partly
frozen model (Dex, LoRA) trains just its trainable set. Its checkpoints hold the full
``state_dict()`` (``model_state.safetensors``, buffers included), the trainer state and
``factory.json``; ``--resume`` loads them into a fresh ``make()``. Model-specific step logic
(e.g. Dex's step t) comes in through ``callbacks``.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffattn.train import distributed
from diffattn.train.building import TrainerBuilding
from diffattn.train.config import (
    TrainConfig,
)
from diffattn.train.context_parallel import (
    SplitRows,
    context_parallel_backward,
    context_parallel_forward,
    context_parallel_group,
)
from diffattn.train.evaluation import Evaluation, evaluate, inputs_on, model_inputs
from diffattn.train.factory import NoProbe
from diffattn.train.metrics import MetricsLogger, Progress
from diffattn.train.outcome import StepState, TrainingDiverged, TrainResult
from diffattn.train.parallel import (
    gradient_sync,
)
from diffattn.train.precision import autocast, compute_dtype
from diffattn.train.saving import CheckpointSaving
from diffattn.train.targets import target_count, weighted_loss

Callback = Callable[[StepState], None]


class _SignalCatcher:
    """SIGINT/SIGTERM set a flag (the run saves and stops); a second one acts at once."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._handle)

    def _handle(self, number: int, frame: Any) -> None:
        name = signal.Signals(number).name
        if self.received is not None:  # second signal: give up waiting for the step
            self.restore()
            signal.raise_signal(number)
            return
        self.received = name

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}


def _plain(value: Any) -> float:
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


# ----------------------------------------------------------------------------------------
def train(
    config: TrainConfig,
    out_dir: str | Path,
    resume: bool | int = False,
    progress: bool = True,
    callbacks: Sequence[Callback] = (),
    data: Any | None = None,
    model_factory: Callable[[], nn.Module] | None = None,
    overwrite: bool = False,
    resume_fallback: bool = False,
) -> TrainResult:
    """Train ``config`` into ``out_dir``: ``Trainer(config, out_dir, ...).run()``.

    Args:
        config: a validated :class:`TrainConfig`.
        out_dir: run directory (``metrics.jsonl``, ``config.yaml``, ``checkpoints/``).
        resume: ``True``: continue from the newest checkpoint in ``out_dir`` (an error if
            none); a step (``int``): from that step's checkpoint, the newer ones set aside in
            ``out_dir/superseded/`` (:mod:`diffattn.train.resume`).
        progress: show a progress bar and messages (rank 0).
        callbacks: called on every rank after each optimizer step with a :class:`StepState`.
        data: an already prepared dataset (``diffattn.data.prepare_data``'s result), e.g. to
            train several models on the same tokens; default: prepared from ``config.data``.
        model_factory: builds the model to train instead of ``config.model``'s preset
            (see the module docstring); called once, after seeding with ``config.seed``.
        overwrite: replace a non-empty ``out_dir`` that holds another run (or this run's
            checkpoints) instead of refusing it; its old contents are removed before the
            run writes anything. Excludes ``resume``.
        resume_fallback: with ``resume``, when the newest checkpoint's files are cut off or
            unreadable, resume from the newest valid one (printed with the skipped ones).

    Raises:
        ConfigError: an invalid setting or resume request (before any file is written).
        TrainingDiverged: a NaN/Inf loss or gradient norm.
    """
    trainer = Trainer(
        config,
        out_dir,
        resume=resume,
        progress=progress,
        callbacks=callbacks,
        data=data,
        model_factory=model_factory,
        overwrite=overwrite,
        resume_fallback=resume_fallback,
    )
    return trainer.run()


class Trainer(TrainerBuilding, CheckpointSaving):
    """One training run of ``config`` into ``out_dir``; the arguments are :func:`train`'s.

    ``run()`` builds, trains to ``config.steps`` and returns a :class:`TrainResult`. The parts
    can also be driven one by one::

        trainer = Trainer(config, out).build()
        state = trainer.train_step()                  # one optimizer step -> StepState
        trainer.evaluate(return_token_losses=True)    # -> Evaluation(loss, token_losses)
        trainer.save()                                # checkpoint of trainer.step
        trainer.close()

    After :meth:`build`, ``model`` is the trained module (unwrapped from DDP, sharded in place
    under FSDP2), ``parallel_model`` what the forward passes run on, ``step`` the last
    completed optimizer step.
    """

    def __init__(
        self,
        config: TrainConfig,
        out_dir: str | Path,
        *,
        resume: bool | int = False,
        progress: bool = True,
        callbacks: Sequence[Callback] = (),
        data: Any | None = None,
        model_factory: Callable[[], nn.Module] | None = None,
        overwrite: bool = False,
        resume_fallback: bool = False,
    ) -> None:
        self.config = config
        self.out = Path(out_dir)
        self.resume = resume if resume is not False else resume_fallback
        self.overwrite = overwrite
        self.resume_fallback = resume_fallback
        self.clear_output = False
        self.progress = progress
        self.callbacks = list(callbacks)
        self.data = data
        self.model_factory = model_factory
        self.built = False
        self.step = 0
        self.tokens = 0
        self.elapsed_before = 0.0
        self.losses: dict[int, float] = {}
        self.val_losses: dict[int, float] = {}
        self.record: dict[str, Any] = {}
        self.stopped: str | None = None
        self.eval_list: list[torch.Tensor] | None = None
        self.checkpoint_found: Path | None = None
        self.last_checkpoint: Path | None = None
        self.last_saved_step = -1
        self.logger: MetricsLogger | None = None
        self.probe: Any = NoProbe()
        self.cp_group = None  # the context-parallel group of this rank (cp > 1: _launch)
        self._signals = _SignalCatcher()
        self._bar: Progress | None = None
        self._window: list[float] = []
        self._window_time = 0.0
        self._t_start = time.perf_counter()

    # ------------------------------------------------------------------------------------
    # build
    def build(self) -> Trainer:
        """Launch, data, model (parallelised), optimizer, schedule, loader, resume, output.

        Raises :class:`ConfigError` for an invalid setting before any file is written.
        """
        self._launch()
        self._build_data()
        self._build_model()
        self._build_optimizer()
        self._build_loader()
        if self.checkpoint_found is not None:
            self._resume_from(self.checkpoint_found)
        if self.config.eval_every:
            self._build_eval_batches(announce=True)
        self._open_output()
        self.built = True
        self.last_checkpoint = self.checkpoint_found
        self.last_saved_step = self.step if self.checkpoint_found is not None else -1
        self.parallel_model.train()
        self._t_start = time.perf_counter()
        return self

    def _launch(self) -> None:
        """:meth:`TrainerBuilding._launch`, then the context-parallel groups of ``cp`` ranks
        (``tp`` apart), which read the same rows: one data-parallel rank per ``cp·tp``."""
        super()._launch()
        cp, tp = self.config.cp, self.config.tp
        if cp > 1:
            self.cp_group = context_parallel_group(cp, self.world, self.env.rank, stride=tp)

    def _say(self, message: str) -> None:
        if self.progress and self.main:
            print(message, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------------------
    # one step
    def forward_backward_step(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of this rank's rows of one global batch, in micro batches.

        The loss and every gradient are the mean over all next-token targets of the global
        batch, whatever the micro-batch size, accumulation or number of ranks
        (:mod:`diffattn.train.targets`: each micro batch's mean weighted by its targets).
        Gradients accumulate and are synchronised over ranks on the last micro batch only.
        Returns this rank's weighted loss and the number of targets over all ranks (both
        detached, 0-dim; their ratio after summing the losses over ranks is the mean).
        """
        config, device = self.config, self.device
        chunks = batch.split(self.micro)
        inputs = [self._inputs(chunk) for chunk in chunks]  # on the host: no device sync
        counts = [target_count(chunk_inputs) for chunk_inputs in inputs]
        total = torch.tensor(float(sum(counts)), device=device)
        distributed.all_reduce_sum(total)
        loss_sum = torch.zeros((), device=device, dtype=torch.float32)
        for index, (chunk, count) in enumerate(zip(chunks, counts, strict=True)):
            last = index == self.accumulation - 1
            share = total / (self.world * max(count, 1))
            chunk, chunk_inputs = inputs_on(device, chunk, inputs[index], count)
            with gradient_sync(self.parallel_model, config.parallel, sync=last):
                with autocast(device, config.dtype), self.probe.capture():
                    if self.cp_group is None:
                        output = self.parallel_model(chunk, **chunk_inputs)
                    else:  # this rank's chunks of the rows (context parallelism)
                        output = context_parallel_forward(
                            self.parallel_model, chunk, self.cp_group, **chunk_inputs
                        )
                loss = weighted_loss(output, count, share)
                if self.cp_group is None:
                    loss.backward()
                else:
                    context_parallel_backward(loss, output, config.cp)
            loss_sum += loss.detach().float()
        return loss_sum, total

    def _inputs(self, chunk: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's keyword arguments besides the tokens: the labels, and the documents
        with ``document_masking``."""
        return model_inputs(chunk, self.eos_id if self.config.document_masking else None)

    def train_step(self) -> StepState:
        """One optimizer step (see the module docstring); returns what the callbacks saw.

        Sets ``stopped`` when a signal or a callback asks the run to end after this step.

        Raises:
            TrainingDiverged: a non-finite loss or gradient norm (the weights stay as they
                were before this step).
        """
        config = self.config
        step = self.step + 1
        t0 = time.perf_counter()
        lr = self.schedule.apply(self.optimizer, step)
        local_loss, targets = self.forward_backward_step(self._next_batch(step))
        max_norm = config.optim.clip if config.optim.clip else math.inf
        grad_norm = _plain(torch.nn.utils.clip_grad_norm_(self.trainable, max_norm))
        loss, stop_requested = self._agree(local_loss, targets, step)
        self._check_finite(step, loss, grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        self.tokens += self.tokens_per_step
        state = StepState(
            step, loss, lr, grad_norm, self.tokens, self.model, self.optimizer, config
        )
        for callback in self.callbacks:
            callback(state)
        self._account(state, time.perf_counter() - t0)
        if stop_requested:
            self.stopped = self._signals.received or "SIGTERM"
        elif state.stop:
            self.stopped = "callback"
        return state

    def _account(self, state: StepState, step_time: float) -> None:
        """Record the step's loss (losses, spike detector, logging window, progress bar)."""
        self.losses[state.step] = state.loss
        self.spikes.update(state.loss)
        self._window.append(state.loss)
        self._window_time += step_time
        if self._bar is not None:
            self._bar.update(state.loss, state.lr, self.tokens_per_step / max(step_time, 1e-9))

    @property
    def tokens_per_step(self) -> int:
        return self.config.global_batch_size * self.config.seq_len

    def _next_batch(self, step: int) -> torch.Tensor:
        try:
            batch = next(self.batches)
        except StopIteration:
            raise RuntimeError(f"the training data ran out at step {step}") from None
        expected = (self.local_batch, self.config.seq_len)
        if tuple(batch.shape) != expected:
            raise RuntimeError(
                f"the data loader gave a batch of shape {tuple(batch.shape)}, expected {expected}"
            )
        return batch

    def _agree(
        self, local_loss: torch.Tensor, targets: torch.Tensor, step: int
    ) -> tuple[float, bool]:
        """The mean loss over all targets of the global batch (the ranks' weighted losses
        summed, over ``world``), and whether any rank received a stop signal."""
        if not float(targets):
            raise RuntimeError(
                f"the global batch of step {step} has no loss target: every window is made of "
                "one-token documents (document_masking) or ignored labels"
            )
        flag = 1.0 if self._signals.received else 0.0
        agreed = torch.stack([local_loss, torch.tensor(flag, device=self.device)])
        distributed.all_reduce_sum(agreed)
        return float(agreed[0]) / self.world, float(agreed[1]) > 0

    def _check_finite(self, step: int, loss: float, grad_norm: float) -> None:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return
        self.optimizer.zero_grad(set_to_none=True)
        what = "loss" if not math.isfinite(loss) else "gradient norm"
        raise TrainingDiverged(
            f"non-finite {what} at step {step} (loss {loss}, grad norm {grad_norm}); stopped "
            f"before updating the weights; {self._last_good()}. Lower optim.lr or raise "
            "schedule.warmup_steps, then resume.",
            step,
            self.last_checkpoint,
        )

    def _last_good(self) -> str:
        if self.last_checkpoint is None:
            return "no checkpoint was written"
        return f"the last good checkpoint is {self.last_checkpoint}"

    # ------------------------------------------------------------------------------------
    # evaluation
    def evaluate(self, return_token_losses: bool = False) -> Evaluation:
        """The mean loss over every rank's rows of the fixed validation batches.

        With ``return_token_losses`` the result also holds this rank's per-token
        next-token losses (see :func:`evaluate`). Collective under DDP/FSDP2.
        """
        batches = self.eval_list if self.eval_list is not None else self._build_eval_batches()
        model = self.model
        if self.cp_group is not None:  # validation rows split as training's are
            model = SplitRows(self.model, self.cp_group, return_token_losses)
        return evaluate(
            model,
            batches,
            self.micro,
            self.device,
            self.config.dtype,
            return_token_losses=return_token_losses,
            eos_id=self.eos_id if self.config.document_masking else None,
        )

    # ------------------------------------------------------------------------------------
    # the run
    def run(self) -> TrainResult:
        """Build (unless built), train to ``config.steps`` (or a stop), close; the result."""
        if not self.built:
            self.build()
        self._bar = Progress(
            self.progress and self.main, total=self.config.steps, initial=self.step
        )
        self._t_start = time.perf_counter()
        self._signals.install()
        try:
            while self.step < self.config.steps and self.stopped is None:
                state = self.train_step()
                self._log_evaluate_save(state)
            if self.sharded is not None:
                self.sharded.wait()  # the last save in flight is renamed before the end
        finally:
            self.close()
        return self.result()

    def _log_evaluate_save(self, state: StepState) -> None:
        """After a step: log (with validation) and checkpoint when due, and at the end."""
        config, step = self.config, state.step
        last = step == config.steps or self.stopped is not None
        do_eval = bool(config.eval_every and self.eval_list) and (
            step % config.eval_every == 0 or step == config.steps
        )
        if step % config.log_every == 0 or last or do_eval:
            self._log(state, do_eval)
        if self.sharded is not None:
            self.sharded.poll()  # an asynchronous save whose writes are done is renamed
        due = bool(config.checkpoint_every) and step % config.checkpoint_every == 0
        if (due or last) and step != self.last_saved_step:
            saved = self.save()
            self._write(f"step {step}: checkpoint {saved}")
        if self.stopped is not None:
            self._write(
                f"step {step}: stopped by {self.stopped}; checkpoint {self.last_checkpoint}"
            )

    def _log(self, state: StepState, do_eval: bool) -> None:
        window, window_time = self._window, self._window_time
        record = {
            "step": state.step,
            "loss": state.loss,
            "loss_mean": sum(window) / len(window),
            "lr": state.lr,
            "grad_norm": state.grad_norm,
            "tokens": state.tokens,
            "tokens_per_s": self.tokens_per_step * len(window) / max(window_time, 1e-9),
            **self._utilisation(self.tokens_per_step * len(window) / max(window_time, 1e-9)),
            "step_time_s": window_time / len(window),
            "elapsed_s": self.elapsed_s,
            "loss_spikes": self.spikes.count,
        }
        record.update(self.probe.collect(self.device))
        if self.device.type == "cuda":
            record["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if do_eval:
            val = self.evaluate().loss
            record["val_loss"] = val
            self.val_losses[state.step] = val
        record.update(state.metrics)
        self.logger.log(record)
        self.record = record
        self._window, self._window_time = [], 0.0

    def _utilisation(self, tokens_per_s: float) -> dict[str, float]:
        """``model_tflops_per_rank`` (the model's training FLOPs — forward plus backward, no
        recomputation — per second and rank) and, on a device whose dense peak is known
        (``diffattn.hardware``), ``mfu``; nothing for ``model_factory`` models."""
        if self.model_config is None or self.model_factory is not None:
            return {}
        from diffattn.flops import flops_per_token
        from diffattn.hardware import device_name, mfu, peak_tflops

        per_token = flops_per_token(self.model_config, self.config.seq_len).training
        per_rank = tokens_per_s / self.world
        out = {"model_tflops_per_rank": per_token * per_rank / 1e12}
        dtype = "bf16" if compute_dtype(self.device, self.config.dtype) != torch.float32 else "fp32"
        peak = peak_tflops(device_name(self.device.type), dtype)
        if peak is not None:
            out["mfu"] = mfu(per_token, per_rank, peak)
        return out

    def _write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message)

    @property
    def elapsed_s(self) -> float:
        """Training time since step 0 (this call's and the checkpoint's)."""
        return self.elapsed_before + (time.perf_counter() - self._t_start)

    def close(self) -> None:
        """Restore the signal handlers, close the progress bar, the logger and the probe; a
        sharded save still in flight here (the run failed) is dropped, never completed."""
        if getattr(self, "sharded", None) is not None:
            self.sharded.abandon()
        self._signals.restore()
        if self._bar is not None:
            self._bar.close()
        if self.logger is not None:
            self.logger.close()
        self.probe.remove()

    def result(self) -> TrainResult:
        return TrainResult(
            out_dir=self.out,
            checkpoint=self.last_checkpoint,
            step=self.step,
            losses=self.losses,
            val_losses=self.val_losses,
            final=self.record,
            num_parameters=self.num_parameters,
            model_config=self.model_config,
            tokens=self.tokens,
            elapsed_s=self.elapsed_s,
            stopped=self.stopped,
            trainable_parameters=self.num_trainable,
        )
