"""The training loop: :class:`Trainer` runs a :class:`TrainConfig`, returns a :class:`TrainResult`.

``train(config, out)`` is ``Trainer(config, out).run()``. The trainer's parts, in the order
``run`` uses them:

* :meth:`Trainer.build`: launch (torchrun environment, process group, resume plan), data,
  model (a preset or ``model_factory()``, parallelised with DDP or FSDP2), optimizer and
  schedule, data loader, resume state, validation batches, output directory and logger.
* :meth:`Trainer.train_step`: one optimizer step. Set the learning rate for the step; take
  the rank's share of the global batch (``global_batch_size / world`` sequences of
  ``seq_len`` tokens) and run :meth:`Trainer.forward_backward_step` on it: micro batches of
  ``micro_batch_size`` with bf16 autocast on CUDA, each micro loss scaled by 1/accumulation,
  gradients synchronised only on the last one. Then clip the global gradient norm; agree over
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

import contextlib
import math
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from diffattn import fileio
from diffattn.config import ModelConfig
from diffattn.model import DiffTransformerLM, labels_within_documents
from diffattn.probe import eval_mode, token_nll
from diffattn.train import checkpoint as ckpt
from diffattn.train import distributed
from diffattn.train.config import (
    ConfigError,
    TrainConfig,
    check_runtime,
    dump_config,
)
from diffattn.train.metrics import LambdaProbe, MetricsLogger, Progress, SpikeDetector
from diffattn.train.optim import LRSchedule, build_optimizer
from diffattn.train.parallel import (
    build_model,
    full_model_state,
    full_optimizer_state,
    gradient_sync,
    load_full_model_state,
    load_full_optimizer_state,
    parallelize,
    unwrap,
)
from diffattn.train.resume import (
    CONFIG_COPY_NAME,
    FACTORY_MARKER_NAME,
    StartPlan,
    plan_start,
    set_aside,
)
from diffattn.train.sharded import ShardedCheckpointer, is_sharded, load_sharded

FACTORY_STATE_NAME = "model_state.safetensors"
HF_WEIGHTS_NAME = "model.safetensors"
"""A Hugging Face factory model's weights, named as ``save_pretrained`` names them."""
TOKENIZER_DIRNAME = "tokenizer"
# ModelConfig fields in which an ``init_from`` model may differ from the run's model: they change
# no weight (RoPE's inverse frequencies are a buffer rebuilt from rope_theta, not saved).
INIT_FREE_FIELDS = ("rope_theta", "max_seq_len")


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/Inf; the weights of the previous step are kept."""

    def __init__(self, message: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


@dataclass
class StepState:
    """What a step callback sees, after the optimizer step of ``step`` (on every rank).

    ``model`` is the trained module (unwrapped from DDP, sharded in place under FSDP2).
    A callback may add entries to ``metrics`` (logged with the step when it is a logging
    step) or set ``stop = True`` to end the run after this step with a checkpoint.
    """

    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    config: TrainConfig
    metrics: dict[str, Any] = field(default_factory=dict)
    stop: bool = False


Callback = Callable[[StepState], None]


@dataclass
class TrainResult:
    """The outcome of :func:`train`."""

    out_dir: Path
    checkpoint: Path | None
    """The last checkpoint (a loadable model directory)."""
    step: int
    """The last completed optimizer step."""
    losses: dict[int, float]
    """Training loss per step run by this call (a resumed call starts after the checkpoint)."""
    val_losses: dict[int, float]
    final: dict[str, Any]
    """The last metrics record."""
    num_parameters: int
    model_config: ModelConfig | None
    """The preset's config; for a ``model_factory`` run the model's own config when it is a
    :class:`~diffattn.DiffTransformerLM`, else ``None``."""
    tokens: int
    """Tokens trained on since step 0."""
    elapsed_s: float
    stopped: str | None = None
    """``None`` when all steps ran, else ``SIGINT``, ``SIGTERM`` or ``callback``."""
    trainable_parameters: int = 0
    """Parameters with ``requires_grad`` (all of them for a preset run)."""

    @property
    def exit_code(self) -> int:
        """0, or 128 + the signal number when a signal stopped the run."""
        if self.stopped in ("SIGINT", "SIGTERM"):
            return 128 + int(getattr(signal, self.stopped))
        return 0


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def compute_dtype(device: torch.device, dtype: str) -> torch.dtype:
    """The autocast dtype of a run: ``bf16``, or ``auto`` on CUDA, is bf16; else fp32."""
    bf16 = dtype == "bf16" or (dtype == "auto" and device.type == "cuda")
    return torch.bfloat16 if bf16 else torch.float32


def _autocast(device: torch.device, dtype: str):
    if compute_dtype(device, dtype) == torch.bfloat16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


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
        resume=resume if resume is not False else resume_fallback,
        progress=progress,
        callbacks=callbacks,
        data=data,
        model_factory=model_factory,
        overwrite=overwrite,
        resume_fallback=resume_fallback,
    )
    return trainer.run()


class Trainer:
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
        self.probe: Any = _NoProbe()
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
        """Read the launch, join the process group, and plan the resume (rank 0 decides)."""
        config = self.config
        try:
            env = distributed.read_env()
        except ValueError as error:
            raise ConfigError("environment", str(error)) from None
        check_runtime(config, env)
        if config.tp > 1 and self.model_factory is not None:
            raise ConfigError("tp", "applies to preset models, not to a model_factory")
        self.model_config = config.model_config() if self.model_factory is None else None
        self._data_config = config.data_config() if self.data is None else None
        self.env = env
        self.world = env.world_size
        # data-parallel ranks: the ranks of one tensor-parallel group read the same rows
        self.dp_world, self.dp_rank = env.world_size // config.tp, env.rank // config.tp
        self.main = env.is_main
        self.device = distributed.resolve_device(config.device, env)
        distributed.init_process_group(env, self.device)
        plan = (
            plan_start(
                config,
                self.model_config,
                self.out,
                self.resume,
                self.overwrite,
                self.resume_fallback,
            )
            if self.main
            else None
        )
        plan: StartPlan = distributed.broadcast_object(plan)
        if plan.error is not None:
            raise ConfigError(*plan.error)
        self.checkpoint_found = plan.checkpoint
        self.clear_output = plan.clear
        self.superseded = plan.superseded
        self.notes: list[str] = list(plan.notes)
        self.init_source = None
        if plan.checkpoint is None and config.init_from is not None:
            self.init_source, change = _check_init_from(Path(config.init_from), self.model_config)
            self.notes.append(f"starting from the weights of {self.init_source}{change}")
        if self.main:
            for message in plan.messages:  # shown even with --quiet: the run differs from asked
                print(f"diffattn train: {message}", file=sys.stderr, flush=True)

    def _build_data(self) -> None:
        """Prepare the data (rank 0 first, then the others from its cache)."""
        from diffattn.data import prepare_data

        if self.data is None:
            try:
                if self.main:
                    self.data = prepare_data(self._data_config, progress=self.progress)
                distributed.barrier()
                if not self.main:
                    self.data = prepare_data(self._data_config, progress=False)
            except ValueError as error:  # a missing source, an empty corpus, ...
                raise ConfigError("data", str(error)) from None
        self.vocab = int(self.data.tokenizer.vocab_size)
        model_config = self.model_config
        if model_config is not None and self.vocab > model_config.vocab_size:
            raise ConfigError(
                "model.vocab_size",
                f"{model_config.vocab_size} is smaller than the tokenizer's {self.vocab} tokens "
                f"({getattr(self.data.tokenizer, 'name', 'tokenizer')})",
            )

    def _build_model(self) -> None:
        """The seeded model, parallelised; a resumed run's weights loaded into it."""
        seed_everything(self.config.seed)
        if self.model_factory is None:
            self.parallel_model = self._build_preset_model()
        else:
            self.parallel_model = self._build_factory_model()
        self.model = unwrap(self.parallel_model)
        if self.model_factory is not None:
            own = getattr(self.model, "config", None)
            self.model_config = own if isinstance(own, ModelConfig) else None
            if self.config.document_masking and not takes_document_ids(self.model):
                raise ConfigError(
                    "document_masking",
                    f"the model_factory model ({type(self.model).__name__}) takes no "
                    "document_ids in forward, so it would attend across documents; use a "
                    "diffattn model or turn document_masking off",
                )
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.num_trainable = sum(p.numel() for p in self.trainable)

    def _build_preset_model(self) -> nn.Module:
        config = self.config
        found = self.checkpoint_found or self.init_source
        # a sharded checkpoint is read into the built model's shards (_resume_from)
        initial_state_needed = found is not None and not is_sharded(found)
        initial_state = (
            ckpt.load_model_state(found) if (initial_state_needed and self.main) else None
        )
        return build_model(
            self.model_config,
            mode=config.parallel,
            device=self.device,
            seed=config.seed,
            fsdp_init="sharded"
            if found is not None and not initial_state_needed
            else config.fsdp_init,
            activation_checkpointing=config.activation_checkpointing,
            selective_ac=config.selective_ac,
            compile=config.compile,
            mixed_precision=self._mixed_precision(),
            initial_state=initial_state,
            load_initial_state=found is not None and initial_state_needed,
            tp=config.tp,
        )

    def _mixed_precision(self) -> torch.dtype | None:
        """FSDP2's parameter dtype (``fsdp_mixed_precision``), or ``None``: fp32 all-gathers."""
        config = self.config
        if config.parallel != "fsdp" or not config.fsdp_mixed_precision:
            return None
        dtype = compute_dtype(self.device, config.dtype)
        return dtype if dtype != torch.float32 else None

    def _build_factory_model(self) -> nn.Module:
        """``model_factory()`` on every rank (the same seed, so the same weights), moved to the
        device and parallelised. A checkpoint is read by rank 0 only: loaded before the DDP
        wrapper broadcasts rank 0's weights, or broadcast into the FSDP2 shards."""
        mode, found = self.config.parallel, self.checkpoint_found
        model = _factory_model(self.model_factory, self.vocab)
        state = _read_factory_state(found) if (found and self.main) else None
        if state is not None and mode != "fsdp":
            _load_factory_state(model, state, found)
        try:
            wrapped = parallelize(
                model.to(self.device), mode, self.device, mixed_precision=self._mixed_precision()
            )
        except ValueError as error:  # FSDP2: no decoder blocks, or a parameter it cannot shard
            what, reason = type(model).__name__, str(error).rstrip(".")
            raise ConfigError(
                "parallel", f"{mode} cannot wrap {what}: {reason}; use parallel: ddp"
            ) from None
        if found is not None and mode == "fsdp":
            load_full_model_state(wrapped, state)
        return wrapped

    def _build_optimizer(self) -> None:
        self.optimizer = build_optimizer(self.model, self.config.optim)
        self.schedule = LRSchedule(
            self.config.optim.lr, self.config.schedule, self.config.decay_horizon
        )

    def _build_loader(self) -> None:
        """This rank's share of each global batch, in micro batches."""
        from diffattn.data import BatchLoader

        config = self.config
        self.local_batch = config.global_batch_size // self.dp_world
        self.micro = config.micro_batch_size or self.local_batch
        self.accumulation = self.local_batch // self.micro
        self.loader = BatchLoader(
            self.data.train,
            batch_size=config.global_batch_size,
            seq_len=config.seq_len,
            seed=config.seed,
            rank=self.dp_rank,
            world_size=self.dp_world,
        )
        loader = self.loader
        self.batches = loader if hasattr(loader, "__next__") else iter(loader)
        self.eos_id = loader.data.eos_id
        self.spikes = SpikeDetector(config.spike_factor, config.spike_window)

    def _resume_from(self, found: Path) -> None:
        """Optimizer, counters, spike detector, loader position and RNG of the checkpoint."""
        main = self.main
        state = ckpt.load_trainer_state(found) if main else None
        if is_sharded(found):  # the model and optimizer shards, resharded to this launch
            load_sharded(found, self.parallel_model, self.optimizer)
        else:
            optimizer_state = state.pop("optimizer") if main else None
            load_full_optimizer_state(self.parallel_model, self.optimizer, optimizer_state)
        state = distributed.broadcast_object(state)
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self.elapsed_before = float(state.get("elapsed_s", 0.0))
        self.spikes.load_state_dict(state["spikes"])
        rank_states = state["rank_states"]
        own = rank_states[self.env.rank] if len(rank_states) == self.world else rank_states[0]
        self.loader.load_state_dict(own["loader"])
        ckpt.restore_rng_state(own["rng"])
        changes = self.schedule.describe_changes(state["schedule"])
        self.notes += [f"schedule {change}" for change in changes]

    def _build_eval_batches(self, announce: bool = False) -> list[torch.Tensor]:
        """The fixed validation batches (this rank's rows): ``eval_batches`` batches of
        windows spread evenly over the validation stream, the same for every launch; empty
        when the split is too small, with a note when ``announce``."""
        from diffattn.data import eval_batches

        config = self.config
        self.eval_list = []
        try:
            self.eval_list = list(
                eval_batches(
                    self.data.valid,
                    config.eval_batch_size or config.global_batch_size,
                    config.seq_len,
                    config.eval_batches,
                    rank=self.dp_rank,
                    world_size=self.dp_world,
                    drop_last=True,
                )
            )
        except ValueError as error:
            if announce:
                self._say(f"note: no validation loss ({error})")
        return self.eval_list

    def _open_output(self) -> None:
        """The run directory (rank 0 writes), the metrics logger and the opening messages."""
        config, out = self.config, self.out
        self.checkpoint_root = out / ckpt.CHECKPOINTS_DIRNAME
        self.sharded = None
        if self._checkpoint_format() == "sharded":
            self.sharded = ShardedCheckpointer(self.checkpoint_root, self.config.async_checkpoint)
        self.tokenizer_dir = None
        if self.main:
            if self.clear_output:  # overwrite, or a restart of this run that saved nothing
                fileio.clear_output_directory(out)
            out.mkdir(parents=True, exist_ok=True)
            fileio.remove_partial_writes(self.checkpoint_root)
            self._continue_entries()
            (out / CONFIG_COPY_NAME).write_text(dump_config(config), encoding="utf-8")
            self.tokenizer_dir = _save_tokenizer_once(self.data.tokenizer, out / TOKENIZER_DIRNAME)
        self.logger = MetricsLogger(
            out,
            enabled=self.main,
            resume_step=self.step if self.checkpoint_found is not None else None,
            tensorboard=config.tensorboard,
            wandb=config.wandb,
            wandb_project=config.wandb_project,
            run_name=config.run_name,
            config=config.to_dict(),
        )
        if isinstance(self.model, DiffTransformerLM):
            self.probe = LambdaProbe(self.model)
        self._announce()

    def _announce(self) -> None:
        config = self.config
        model_config = self.model_config
        what = model_config.attention if model_config is not None else type(self.model).__name__
        if self.num_trainable != self.num_parameters:
            what += f" · {self.num_trainable:,} trainable of"
        self._say(
            f"diffattn train: {what} {self.num_parameters:,} parameters · "
            f"{config.parallel} on {self.world} × {self.device.type}"
            f"{f' (tp {config.tp})' if config.tp > 1 else ''} · global batch "
            f"{config.global_batch_size} × {config.seq_len} tokens · micro {self.micro} × "
            f"{self.accumulation} accumulation"
        )
        if self.checkpoint_found is not None:
            self._say(f"resuming from {self.checkpoint_found} (step {self.step})")
            if self.step >= config.steps:
                self._say(
                    f"nothing to do: the checkpoint is at step {self.step} >= steps={config.steps}"
                )
        for note in self.notes:
            self._say(f"note: {note}")

    def _say(self, message: str) -> None:
        if self.progress and self.main:
            print(message, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------------------
    # one step
    def forward_backward_step(self, batch: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's rows of one global batch, in micro batches.

        Gradients accumulate (each micro loss scaled by 1/accumulation) and are synchronised
        over ranks on the last micro batch only. Returns this rank's mean loss (detached).
        """
        config, device = self.config, self.device
        batch = batch.to(device, non_blocking=True)
        loss_sum = torch.zeros((), device=device, dtype=torch.float32)
        for index, chunk in enumerate(batch.split(self.micro)):
            last = index == self.accumulation - 1
            with gradient_sync(self.parallel_model, config.parallel, sync=last):
                with _autocast(device, config.dtype), self.probe.capture():
                    loss = self.parallel_model(chunk, **self._inputs(chunk)).loss
                (loss / self.accumulation).backward()
            loss_sum += loss.detach().float()
        return loss_sum / self.accumulation

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
        local_loss = self.forward_backward_step(self._next_batch(step))
        max_norm = config.optim.clip if config.optim.clip else math.inf
        grad_norm = _plain(torch.nn.utils.clip_grad_norm_(self.trainable, max_norm))
        loss, stop_requested = self._agree(local_loss)
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

    def _agree(self, local_loss: torch.Tensor) -> tuple[float, bool]:
        """The mean loss over ranks, and whether any rank received a stop signal."""
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
        return evaluate(
            self.model,
            batches,
            self.micro,
            self.device,
            self.config.dtype,
            return_token_losses=return_token_losses,
            eos_id=self.eos_id if self.config.document_masking else None,
        )

    # ------------------------------------------------------------------------------------
    # checkpoints
    def save(self) -> Path:
        """Checkpoint the current step (collective; rank 0 writes); returns its directory.

        Raises:
            TrainingDiverged: the weights are not finite (nothing is written).
        """
        step = self.step
        if not _weights_finite(self.trainable, self.device):
            raise TrainingDiverged(
                f"non-finite weights after step {step}; not saving them. The last good "
                f"checkpoint is {self.last_checkpoint}.",
                step,
                self.last_checkpoint,
            )
        if self.sharded is not None:
            return self._save_sharded(step)
        model_state = full_model_state(self.parallel_model)
        optimizer_state = full_optimizer_state(self.parallel_model, self.optimizer)
        rank_states = distributed.gather_objects(
            {"rng": ckpt.capture_rng_state(), "loader": self.loader.state_dict()}
        )
        outcome: tuple[str | None, str | None] = (None, None)
        if self.main:
            try:
                trainer_state = self._trainer_state(optimizer_state, rank_states)
                written = self._write_checkpoint(model_state, trainer_state)
                self._point_entries(written, final=step >= self.config.steps)
                outcome = (str(written), None)
            except Exception as exc:  # every rank must learn about it
                outcome = (None, f"{type(exc).__name__}: {exc}")
        path, failure = distributed.broadcast_object(outcome)
        if failure is not None:
            raise RuntimeError(f"saving the checkpoint of step {step} failed: {failure}")
        self.last_checkpoint = Path(path)
        self.last_saved_step = step
        return self.last_checkpoint

    def _save_sharded(self, step: int) -> Path:
        """Each rank writes its shards (:mod:`diffattn.train.sharded`); rank 0 the rest."""
        rank_states = distributed.gather_objects(
            {"rng": ckpt.capture_rng_state(), "loader": self.loader.state_dict()}
        )

        def write_small_files(tmp: Path) -> None:
            state = self._trainer_state(None, rank_states)
            state["sharded"] = True
            config_yaml = dump_config(self.config)
            ckpt.write_run_files(tmp, state, config_yaml, self.tokenizer_dir, self.model_config)

        def finish(path: Path) -> None:
            ckpt.prune(self.checkpoint_root, self.config.keep_last)
            self._point_entries(path, final=step >= self.config.steps)

        model, optimizer = self.parallel_model, self.optimizer
        path = self.sharded.save(step, model, optimizer, write_small_files, finish)
        self.last_checkpoint = path
        self.last_saved_step = step
        return path

    def _checkpoint_format(self) -> str:
        """``full`` or ``sharded`` (``auto``: sharded for preset models under FSDP2)."""
        chosen = self.config.checkpoint_format
        if chosen == "auto":
            preset = self.model_factory is None
            chosen = "sharded" if preset and self.config.parallel == "fsdp" else "full"
        if chosen == "sharded" and self.model_factory is not None:
            raise ConfigError(
                "checkpoint_format",
                "sharded checkpoints are for preset models, not a model_factory",
            )
        if self.config.async_checkpoint and chosen != "sharded":
            raise ConfigError("async_checkpoint", "needs checkpoint_format: sharded")
        return chosen

    def _continue_entries(self) -> None:
        """On a resume (rank 0): checkpoints after the resumed step go to ``superseded/``,
        ``latest`` points at the resumed one, and ``final`` goes until the run reaches its new
        last step."""
        root, found = self.checkpoint_root, self.checkpoint_found
        if found is None:
            return
        for moved in set_aside(self.out, self.superseded) if self.superseded else ():
            self._say(f"note: set aside {moved}")
        self._point_entries(found, final=False)
        if self.step < self.config.steps:
            ckpt.clear_entry(root, ckpt.FINAL_ENTRY)

    def _point_entries(self, checkpoint: Path, final: bool) -> None:
        """``latest`` (and, at the run's last step, ``final``) link to ``checkpoint``."""
        ckpt.point_entry(self.checkpoint_root, ckpt.LATEST_ENTRY, checkpoint)
        if final:
            ckpt.point_entry(self.checkpoint_root, ckpt.FINAL_ENTRY, checkpoint)

    def _trainer_state(self, optimizer_state: dict | None, rank_states: list) -> dict[str, Any]:
        """What ``trainer_state.pt`` holds (the optimizer only when it is not sharded)."""
        self.logger.flush()
        state = {
            "step": self.step,
            "tokens": self.tokens,
            "world_size": self.world,
            "elapsed_s": self.elapsed_s,
            "schedule": self.schedule.state_dict(),
            "spikes": self.spikes.state_dict(),
            "rank_states": rank_states,
        }
        if optimizer_state is not None:
            state["optimizer"] = optimizer_state
        return state

    def _write_checkpoint(self, model_state: dict, trainer_state: dict[str, Any]) -> Path:
        config = self.config
        if self.model_factory is not None:
            return _save_factory_checkpoint(
                self.checkpoint_root,
                self.step,
                self.model,
                model_state,
                trainer_state,
                dump_config(config),
                self.tokenizer_dir,
                config.keep_last,
            )
        return ckpt.save_checkpoint(
            self.checkpoint_root,
            self.step,
            self.model_config,
            model_state,
            trainer_state,
            dump_config(config),
            tokenizer_dir=self.tokenizer_dir,
            keep_last=config.keep_last,
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


# ----------------------------------------------------------------------------------------
# evaluation
@dataclass
class Evaluation:
    """The result of :func:`evaluate` / :meth:`Trainer.evaluate`."""

    loss: float
    """Mean next-token loss over every rank's validation rows."""
    token_losses: torch.Tensor | None = None
    """With ``return_token_losses``: this rank's next-token losses, ``(rows, seq_len - 1)``
    float32 on CPU (row i, column j: −log p(token j+1 | tokens ≤ j))."""


def takes_document_ids(model: nn.Module) -> bool:
    """Whether ``model.forward`` names a ``document_ids`` parameter (a ``**kwargs`` that would
    swallow it does not count)."""
    import inspect

    return "document_ids" in inspect.signature(model.forward).parameters


def model_inputs(chunk: torch.Tensor, eos_id: int | None) -> dict[str, torch.Tensor]:
    """``labels`` (the chunk itself), and ``document_ids`` split at each EOS when ``eos_id`` is
    given (``TrainConfig.document_masking``)."""
    if eos_id is None:
        return {"labels": chunk}
    from diffattn.data import documents_after_eos

    return {"labels": chunk, "document_ids": documents_after_eos(chunk, eos_id)}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    micro_batch_size: int,
    device: torch.device,
    dtype: str = "auto",
    return_token_losses: bool = False,
    eos_id: int | None = None,
) -> Evaluation:
    """Mean validation loss of ``model`` over every rank's rows of ``batches`` (each rank holds
    the same number of rows, run in chunks of ``micro_batch_size``), as the trainer measures.
    With ``eos_id`` the windows are masked by document, as ``document_masking`` trains.

    The mean is the model's own ``.loss`` weighted by rows. With ``return_token_losses`` the
    per-token losses are computed from ``.logits`` of the same forward passes.

    Raises:
        ValueError: ``batches`` is empty (the held-out split is too small).
    """
    if not batches:
        raise ValueError(
            "the held-out split is too small for one evaluation batch; use more text "
            "(data.sources) or lower eval_batch_size"
        )
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    token_losses = []
    with eval_mode(model):
        for batch in batches:
            for chunk in batch.to(device).split(micro_batch_size):
                inputs = model_inputs(chunk, eos_id)
                with _autocast(device, dtype):
                    output = model(chunk, **inputs)
                totals[0] += output.loss.double() * chunk.shape[0]
                totals[1] += chunk.shape[0]
                if return_token_losses:
                    targets = chunk
                    if "document_ids" in inputs:  # no target across a boundary, as the loss
                        targets = labels_within_documents(chunk, inputs["document_ids"])
                    token_losses.append(token_nll(output.logits, targets).cpu())
    distributed.all_reduce_sum(totals)
    losses = torch.cat(token_losses) if return_token_losses else None
    return Evaluation(float(totals[0] / totals[1]), losses)


# ----------------------------------------------------------------------------------------
# helpers
def _check_init_from(path: Path, model_config: ModelConfig | None) -> tuple[Path, str]:
    """``(path, description of the changed fields)`` when ``init_from`` can seed the run's
    model: a diffattn model directory whose model differs at most in
    :data:`INIT_FREE_FIELDS`; else :class:`ConfigError`."""
    if model_config is None:
        raise ConfigError("init_from", "applies to preset models; a model_factory builds its own")
    if not (path / "config.json").is_file():
        raise ConfigError("init_from", f"{path}: not a diffattn model directory (no config.json)")
    try:
        saved = ckpt.read_checkpoint_model_config(path)
    except ValueError as error:
        raise ConfigError("init_from", str(error)) from None
    diffs = ckpt.model_config_differences(saved, model_config)
    fixed = [d for d in diffs if d.split(":", 1)[0] not in INIT_FREE_FIELDS]
    if fixed:
        raise ConfigError(
            "init_from",
            f"{path} has a different model: {'; '.join(fixed)}; only "
            f"{' and '.join(INIT_FREE_FIELDS)} may change",
        )
    changed = [d.replace(" (checkpoint) vs ", " -> ").replace(" (config)", "") for d in diffs]
    return path, (f" ({', '.join(changed)})" if changed else "")


def _factory_model(factory: Callable[[], nn.Module], vocab: int) -> nn.Module:
    """Build a ``model_factory`` model and check that it embeds every token."""
    model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "model_factory", f"must return a torch.nn.Module, got {type(model).__name__}"
        )
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is not None and vocab > rows:
        raise ConfigError(
            "data.tokenizer",
            f"the tokenizer has {vocab} tokens but the model embeds only {rows}",
        )
    return model


def _is_plain_hf_model(model: nn.Module, state: dict[str, torch.Tensor]) -> bool:
    """Whether ``model`` is a Hugging Face causal LM whose state (names and shapes) and modules
    are exactly what ``AutoModelForCausalLM.from_config(model.config)`` builds (built on the
    meta device), so its ``save_pretrained`` form loads back as the same model."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "save_pretrained", None)):
        return False
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            fresh = AutoModelForCausalLM.from_config(config)
    except Exception:  # not a causal LM transformers can build from its config
        return False
    expected = fresh.state_dict()
    if set(expected) != set(state) or any(expected[k].shape != state[k].shape for k in state):
        return False
    own = dict(model.named_modules())  # no module swapped for another under the same names
    return all(isinstance(own.get(name), type(module)) for name, module in fresh.named_modules())


def _read_factory_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The state a factory checkpoint saved: ``model_state.safetensors``, or an HF model's
    ``model.safetensors`` (the marker names the file)."""
    import json

    from safetensors.torch import load_file

    marker = json.loads((checkpoint / FACTORY_MARKER_NAME).read_text())
    return load_file(str(checkpoint / marker.get("weights", FACTORY_STATE_NAME)))


def _load_factory_state(model: nn.Module, state: dict[str, torch.Tensor], checkpoint: Path) -> None:
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ConfigError(
            "resume", f"the checkpoint {checkpoint} does not fit the model: {error}"
        ) from None


def _save_factory_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    config_yaml: str,
    tokenizer_dir: Path | None,
    keep_last: int | None,
) -> Path:
    """A checkpoint of a ``model_factory`` run: the full state dict (parameters and
    persistent buffers, tied tensors stored once per name) as safetensors, the trainer state,
    the config and the tokenizer files, written atomically like the preset runs'.

    A plain Hugging Face model (:func:`_is_plain_hf_model`) is written as its
    ``save_pretrained`` directory instead (``config.json``, ``generation_config.json`` when it
    has one, ``model.safetensors``), so ``from_pretrained``, ``diffattn eval``, ``serve`` and
    the loaders read the checkpoint as any HF model; resume reads the same weights. A model
    with tensors its config does not build (a Dex model's adapter) keeps the state-dict form,
    which the loaders refuse rather than load without those tensors."""
    import json

    from safetensors.torch import save_file

    final = root / ckpt.checkpoint_name(step)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model_state.items()}
    hf_model = _is_plain_hf_model(model, state)
    with fileio.atomic_directory(final, overwrite=True) as tmp:
        weights = HF_WEIGHTS_NAME if hf_model else FACTORY_STATE_NAME
        save_file(state, str(tmp / weights), metadata={"format": "pt"})
        if hf_model:
            model.config.save_pretrained(tmp)
            generation_config = getattr(model, "generation_config", None)
            if generation_config is not None:
                generation_config.save_pretrained(tmp)
        marker = {
            "model_class": type(model).__name__,
            "step": step,
            "tensors": len(state),
            "weights": weights,
        }
        (tmp / FACTORY_MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        torch.save(
            ckpt.to_safe({"format": ckpt.FORMAT_VERSION, **trainer_state}),
            tmp / ckpt.TRAINER_STATE_NAME,
        )
        (tmp / ckpt.CONFIG_YAML_NAME).write_text(config_yaml, encoding="utf-8")
        if tokenizer_dir is not None:
            fileio.copy_tokenizer_files(tokenizer_dir, tmp)
    ckpt.prune(root, keep_last)
    return final


class _NoProbe:
    """The λ probe of a model without diffattn attention layers: records nothing."""

    def capture(self):
        return contextlib.nullcontext()

    def collect(self, device: torch.device) -> dict[str, Any]:
        return {}

    def remove(self) -> None:
        pass


def _save_tokenizer_once(tokenizer: Any, directory: Path) -> Path | None:
    """Save the tokenizer to ``directory`` once (checkpoints copy these files)."""
    if directory.is_dir() and any(directory.iterdir()):
        return directory
    if not hasattr(tokenizer, "save"):
        return None
    with fileio.atomic_directory(directory, overwrite=True) as tmp:
        tokenizer.save(tmp)
    return directory


def _weights_finite(params: list[torch.Tensor], device: torch.device) -> bool:
    """True when every (local shard of every) parameter is finite on every rank."""
    bad = torch.zeros((), device=device)
    with torch.no_grad():
        for param in params:
            local = param.to_local() if hasattr(param, "to_local") else param
            if not bool(torch.isfinite(local).all()):
                bad += 1
                break
    distributed.all_reduce_sum(bad)
    return float(bad) == 0.0
