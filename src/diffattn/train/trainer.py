"""The training loop: :func:`train` runs a :class:`TrainConfig`, returns a :class:`TrainResult`.

One optimizer step: set the learning rate for the step; take the rank's share of the global
batch (``global_batch_size / world`` sequences of ``seq_len`` tokens); run it in micro batches
of ``micro_batch_size`` with bf16 autocast on CUDA, scaling each micro loss by 1/accumulation
and synchronising gradients only on the last one; clip the global gradient norm; agree over
ranks on the mean loss and on stop requests; stop if the loss or the gradient norm is not
finite (weights untouched); take the AdamW step; call the step callbacks; log, evaluate and
checkpoint as configured. Only rank 0 logs and writes.

Exactness: the initial weights depend only on the seed (built on CPU, or broadcast from rank
0 under FSDP2), the data order only on the seed and the step, and a checkpoint holds
everything else (optimizer, schedule, RNG states, loader position, spike detector), so a
resumed run repeats the losses of an uninterrupted one on CPU.

Any model: ``train(config, out, model_factory=make)`` trains the ``nn.Module`` that ``make()``
returns instead of the preset of ``config.model`` (single process only, ``parallel: none``).
Its ``forward(input_ids, labels=input_ids)`` must return an object with ``.loss`` (a
:class:`~diffattn.DiffTransformerLM` and Hugging Face causal LMs both shift the labels
inside). Only parameters with ``requires_grad`` reach the optimizer, so a partly frozen model
(Dex, Kong et al. §3.4; LoRA) trains just its trainable set. Its checkpoints hold the full
``state_dict()`` (``model_state.safetensors``, buffers such as Dex's step t included), the
trainer state and ``factory.json``; ``--resume`` loads them into a fresh ``make()``. A model
carrying Dex layers gets :func:`diffattn.dex.trainer_callback` added, which keeps the Dex step
t of Eq.4 equal to the optimizer step and logs the mean λ(t) as ``dex_lambda``.
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from diffattn.config import ModelConfig
from diffattn.model import DiffTransformerLM
from diffattn.train import checkpoint as ckpt
from diffattn.train import distributed
from diffattn.train.config import ConfigError, TrainConfig, check_runtime, dump_config
from diffattn.train.metrics import LambdaProbe, MetricsLogger, Progress, SpikeDetector
from diffattn.train.optim import LRSchedule, build_optimizer
from diffattn.train.parallel import (
    build_model,
    full_model_state,
    full_optimizer_state,
    gradient_sync,
    load_full_optimizer_state,
    unwrap,
)

CONFIG_COPY_NAME = "config.yaml"
FACTORY_STATE_NAME = "model_state.safetensors"
FACTORY_MARKER_NAME = "factory.json"
TOKENIZER_DIRNAME = "tokenizer"
# Entries that must match the checkpoint for the data order to continue exactly.
RESUME_FIXED_KEYS = ("data", "seq_len", "global_batch_size", "seed")
# Entries that may change on resume without any effect on the numbers.
RESUME_FREE_KEYS = frozenset(
    {
        "steps",
        "log_every",
        "eval_every",
        "eval_batches",
        "eval_batch_size",
        "checkpoint_every",
        "keep_last",
        "tensorboard",
        "wandb",
        "wandb_project",
        "run_name",
        "device",
        "dtype",
        "compile",
        "activation_checkpointing",
        "parallel",
        "fsdp_init",
        "micro_batch_size",
        "spike_factor",
        "spike_window",
    }
)


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/Inf; the weights of the previous step are kept."""

    def __init__(self, message: str, step: int, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


@dataclass
class StepState:
    """What a step callback sees, after the optimizer step of ``step`` (on every rank).

    ``model`` is the :class:`~diffattn.DiffTransformerLM` (sharded in place under FSDP2).
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


def _autocast(device: torch.device, dtype: str):
    if device.type == "cuda" and dtype in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _plain(value: Any) -> float:
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


# ----------------------------------------------------------------------------------------
# resume planning (rank 0 decides, every rank learns the answer)
def _plan(config: TrainConfig, model_config: ModelConfig | None, out: Path, resume: bool):
    """``(checkpoint or None, error (key, message) or None, notes)``.

    ``model_config=None`` marks a ``model_factory`` run: its checkpoints hold a state dict,
    not a diffattn model directory, and the other kind is refused."""
    import yaml

    root = out / ckpt.CHECKPOINTS_DIRNAME
    if not resume:
        if ckpt.list_checkpoints(root):
            return (
                None,
                (
                    "out",
                    f"{out} already holds checkpoints; pass --resume to continue "
                    "that run, or choose another output directory",
                ),
                [],
            )
        return None, None, []
    found = ckpt.latest_checkpoint(root)
    if found is None:
        return None, ("resume", f"no checkpoint found in {root}; start without --resume"), []
    factory_checkpoint = (found / FACTORY_MARKER_NAME).is_file()
    if (model_config is None) != factory_checkpoint:
        kind = "a model_factory" if factory_checkpoint else "a preset"
        return None, ("resume", f"the checkpoint {found} belongs to {kind} run"), []
    if model_config is not None:
        try:
            saved_model = ckpt.read_checkpoint_model_config(found)
        except ValueError as error:
            return None, ("resume", str(error)), []
        diffs = ckpt.model_config_differences(saved_model, model_config)
        if diffs:
            key = "model." + diffs[0].split(":", 1)[0]
            message = f"the checkpoint {found} has a different model: " + "; ".join(diffs)
            return None, (key, message), []
    notes = []
    saved_path = found / ckpt.CONFIG_YAML_NAME
    if saved_path.is_file():
        saved = yaml.safe_load(saved_path.read_text(encoding="utf-8")) or {}
        now = config.to_dict()
        for key in RESUME_FIXED_KEYS:
            if key in saved and saved[key] != now[key]:
                return (
                    None,
                    (
                        key,
                        f"differs from the checkpoint {found} ({saved[key]!r} there, "
                        f"{now[key]!r} now); an exact resume needs the same data, seq_len, "
                        "global_batch_size and seed",
                    ),
                    [],
                )
        for key in now:
            checked = key in RESUME_FREE_KEYS or key in RESUME_FIXED_KEYS or key == "model"
            if key in saved and not checked and saved[key] != now[key]:
                notes.append(f"{key} changed since the checkpoint: {saved[key]!r} -> {now[key]!r}")
    return found, None, notes


# ----------------------------------------------------------------------------------------
def train(
    config: TrainConfig,
    out_dir: str | Path,
    resume: bool = False,
    progress: bool = True,
    callbacks: Sequence[Callback] = (),
    data: Any | None = None,
    model_factory: Callable[[], nn.Module] | None = None,
) -> TrainResult:
    """Train ``config`` into ``out_dir``; see the module docstring for one step.

    Args:
        config: a validated :class:`TrainConfig`.
        out_dir: run directory (``metrics.jsonl``, ``config.yaml``, ``checkpoints/``).
        resume: continue from the newest checkpoint in ``out_dir`` (an error if none).
        progress: show a progress bar and messages (rank 0).
        callbacks: called on every rank after each optimizer step with a :class:`StepState`.
        data: an already prepared dataset (``diffattn.data.prepare_data``'s result), e.g. to
            train several models on the same tokens; default: prepared from ``config.data``.
        model_factory: builds the model to train instead of ``config.model``'s preset
            (see the module docstring); called once, after seeding with ``config.seed``.

    Raises:
        ConfigError: an invalid setting or resume request (before any file is written).
        TrainingDiverged: a NaN/Inf loss or gradient norm.
    """
    try:
        env = distributed.read_env()
    except ValueError as error:
        raise ConfigError("environment", str(error)) from None
    check_runtime(config, env)
    if model_factory is not None and (config.parallel != "none" or env.world_size > 1):
        raise ConfigError("parallel", "a model_factory run trains in one process (parallel: none)")
    model_config = config.model_config() if model_factory is None else None
    data_config = config.data_config() if data is None else None
    device = distributed.resolve_device(config.device, env)
    out = Path(out_dir)
    distributed.init_process_group(env, device)
    main = env.is_main

    def say(message: str) -> None:
        if progress and main:
            print(message, file=sys.stderr, flush=True)

    plan = _plan(config, model_config, out, resume) if main else None
    found, error, notes = distributed.broadcast_object(plan)
    if error is not None:
        raise ConfigError(*error)
    resuming = found is not None

    # data --------------------------------------------------------------------------------
    from diffattn.data import BatchLoader, eval_batches, prepare_data

    if data is None:
        try:
            if main:
                data = prepare_data(data_config, progress=progress)
            distributed.barrier()
            if not main:
                data = prepare_data(data_config, progress=False)
        except ValueError as error:  # a missing source, an empty corpus, ...
            raise ConfigError("data", str(error)) from None
    vocab = int(data.tokenizer.vocab_size)
    if model_config is not None and vocab > model_config.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{model_config.vocab_size} is smaller than the tokenizer's {vocab} tokens "
            f"({getattr(data.tokenizer, 'name', 'tokenizer')})",
        )

    # model, optimizer, schedule, loader --------------------------------------------------
    seed_everything(config.seed)
    if model_factory is not None:
        model = _factory_model(model_factory, found if resuming else None, device, vocab)
        core = model
        model_config = getattr(core, "config", None)
        if not isinstance(model_config, ModelConfig):
            model_config = None
    else:
        initial_state = ckpt.load_model_state(found) if (resuming and main) else None
        model = build_model(
            model_config,
            mode=config.parallel,
            device=device,
            seed=config.seed,
            fsdp_init=config.fsdp_init,
            activation_checkpointing=config.activation_checkpointing,
            compile=config.compile,
            initial_state=initial_state,
            load_initial_state=resuming,
        )
        del initial_state
        core = unwrap(model)
    num_parameters = sum(p.numel() for p in core.parameters())
    num_trainable = sum(p.numel() for p in core.parameters() if p.requires_grad)
    callbacks = list(callbacks)
    if model_factory is not None:
        from diffattn import dex

        if dex.is_dex(core):
            callbacks.insert(0, dex.trainer_callback(core))
    optimizer = build_optimizer(core, config.optim)
    schedule = LRSchedule(config.optim.lr, config.schedule, config.decay_horizon)
    world = env.world_size
    local_batch = config.global_batch_size // world
    micro = config.micro_batch_size or local_batch
    accumulation = local_batch // micro
    loader = BatchLoader(
        data.train,
        batch_size=config.global_batch_size,
        seq_len=config.seq_len,
        seed=config.seed,
        rank=env.rank,
        world_size=world,
    )
    batches = loader if hasattr(loader, "__next__") else iter(loader)
    spikes = SpikeDetector(config.spike_factor, config.spike_window)

    start_step, tokens, elapsed_before = 0, 0, 0.0
    if resuming:
        state = ckpt.load_trainer_state(found) if main else None
        load_full_optimizer_state(model, optimizer, state.pop("optimizer") if main else None)
        state = distributed.broadcast_object(state)
        start_step = int(state["step"])
        tokens = int(state["tokens"])
        elapsed_before = float(state.get("elapsed_s", 0.0))
        spikes.load_state_dict(state["spikes"])
        rank_states = state["rank_states"]
        own = rank_states[env.rank] if len(rank_states) == world else rank_states[0]
        loader.load_state_dict(own["loader"])
        ckpt.restore_rng_state(own["rng"])
        notes += [f"schedule {c}" for c in schedule.describe_changes(state["schedule"])]

    eval_list: list[torch.Tensor] = []
    if config.eval_every:
        try:
            eval_list = list(
                eval_batches(
                    data.valid,
                    config.eval_batch_size or config.global_batch_size,
                    config.seq_len,
                    config.eval_batches,
                    rank=env.rank,
                    world_size=world,
                    drop_last=True,
                )
            )
        except ValueError as error:
            say(f"note: no validation loss ({error})")

    # output ------------------------------------------------------------------------------
    root = out / ckpt.CHECKPOINTS_DIRNAME
    if main:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.remove_partial(root)
        (out / CONFIG_COPY_NAME).write_text(dump_config(config), encoding="utf-8")
        tokenizer_dir = _save_tokenizer_once(data.tokenizer, out / TOKENIZER_DIRNAME)
    else:
        tokenizer_dir = None
    logger = MetricsLogger(
        out,
        enabled=main,
        resume_step=start_step if resuming else None,
        tensorboard=config.tensorboard,
        wandb=config.wandb,
        wandb_project=config.wandb_project,
        run_name=config.run_name,
        config=config.to_dict(),
    )
    probe = LambdaProbe(core) if isinstance(core, DiffTransformerLM) else _NoProbe()
    what = model_config.attention if model_config is not None else type(core).__name__
    if num_trainable != num_parameters:
        what += f" · {num_trainable:,} trainable of"
    say(
        f"diffattn train: {what} {num_parameters:,} parameters · "
        f"{config.parallel} on {world} × {device.type} · global batch "
        f"{config.global_batch_size} × {config.seq_len} tokens · micro {micro} × "
        f"{accumulation} accumulation"
    )
    if resuming:
        say(f"resuming from {found} (step {start_step})")
        if start_step >= config.steps:
            say(f"nothing to do: the checkpoint is at step {start_step} >= steps={config.steps}")
    for note in notes:
        say(f"note: {note}")

    def save(step: int) -> Path:
        if not _weights_finite(trainable, device):
            raise TrainingDiverged(
                f"non-finite weights after step {step}; not saving them. The last good "
                f"checkpoint is {last_checkpoint}.",
                step,
                last_checkpoint,
            )
        model_state = full_model_state(model) if model_factory is None else None
        optim_state = full_optimizer_state(model, optimizer)
        rank_states = distributed.gather_objects(
            {"rng": ckpt.capture_rng_state(), "loader": loader.state_dict()}
        )
        outcome: tuple[str | None, str | None] = (None, None)
        if main:
            try:
                logger.flush()
                trainer_state = {
                    "step": step,
                    "tokens": tokens,
                    "world_size": world,
                    "elapsed_s": elapsed_before + (time.perf_counter() - t_start),
                    "optimizer": optim_state,
                    "schedule": schedule.state_dict(),
                    "spikes": spikes.state_dict(),
                    "rank_states": rank_states,
                }
                if model_factory is not None:
                    path = _save_factory_checkpoint(
                        root,
                        step,
                        core,
                        trainer_state,
                        dump_config(config),
                        tokenizer_dir,
                        config.keep_last,
                    )
                else:
                    path = ckpt.save_checkpoint(
                        root,
                        step,
                        model_config,
                        model_state,
                        trainer_state,
                        dump_config(config),
                        tokenizer_dir=tokenizer_dir,
                        keep_last=config.keep_last,
                    )
                outcome = (str(path), None)
            except Exception as exc:  # every rank must learn about it
                outcome = (None, f"{type(exc).__name__}: {exc}")
        path, failure = distributed.broadcast_object(outcome)
        if failure is not None:
            raise RuntimeError(f"saving the checkpoint of step {step} failed: {failure}")
        return Path(path)

    trainable = [p for p in core.parameters() if p.requires_grad]
    max_norm = config.optim.clip if config.optim.clip else math.inf
    signals = _SignalCatcher()
    bar = Progress(progress and main, total=config.steps, initial=start_step)
    last_checkpoint = found
    last_saved_step = start_step if resuming else -1
    losses: dict[int, float] = {}
    val_losses: dict[int, float] = {}
    record: dict[str, Any] = {}
    window: list[float] = []
    window_time = 0.0
    stopped: str | None = None
    step = start_step
    t_start = time.perf_counter()
    signals.install()
    model.train()
    try:
        while step < config.steps:
            step += 1
            t0 = time.perf_counter()
            lr = schedule.apply(optimizer, step)
            batch = _next_batch(batches, step)
            if tuple(batch.shape) != (local_batch, config.seq_len):
                raise RuntimeError(
                    f"the data loader gave a batch of shape {tuple(batch.shape)}, expected "
                    f"{(local_batch, config.seq_len)}"
                )
            batch = batch.to(device, non_blocking=True)
            loss_sum = torch.zeros((), device=device, dtype=torch.float32)
            for index, chunk in enumerate(batch.split(micro)):
                with gradient_sync(model, config.parallel, sync=index == accumulation - 1):
                    with _autocast(device, config.dtype), probe.capture():
                        loss = model(chunk, labels=chunk).loss
                    (loss / accumulation).backward()
                loss_sum += loss.detach().float()
            grad_norm = _plain(torch.nn.utils.clip_grad_norm_(trainable, max_norm))
            flag = 1.0 if signals.received else 0.0
            agreed = torch.stack([loss_sum / accumulation, torch.tensor(flag, device=device)])
            distributed.all_reduce_sum(agreed)
            loss_value = float(agreed[0]) / world
            stop_requested = float(agreed[1]) > 0
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                optimizer.zero_grad(set_to_none=True)
                what = "loss" if not math.isfinite(loss_value) else "gradient norm"
                where = (
                    f"the last good checkpoint is {last_checkpoint}"
                    if last_checkpoint is not None
                    else "no checkpoint was written"
                )
                raise TrainingDiverged(
                    f"non-finite {what} at step {step} (loss {loss_value}, grad norm "
                    f"{grad_norm}); stopped before updating the weights; {where}. Lower "
                    "optim.lr or raise schedule.warmup_steps, then resume.",
                    step,
                    last_checkpoint,
                )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens += config.global_batch_size * config.seq_len
            state_ = StepState(step, loss_value, lr, grad_norm, tokens, core, optimizer, config)
            for callback in callbacks:
                callback(state_)
            losses[step] = loss_value
            spikes.update(loss_value)
            step_time = time.perf_counter() - t0
            window.append(loss_value)
            window_time += step_time
            tokens_per_s = config.global_batch_size * config.seq_len / max(step_time, 1e-9)
            bar.update(loss_value, lr, tokens_per_s)

            if stop_requested:
                stopped = signals.received or "SIGTERM"
            elif state_.stop:
                stopped = "callback"
            last = step == config.steps or stopped is not None
            do_eval = bool(eval_list) and (step % config.eval_every == 0 or step == config.steps)
            if step % config.log_every == 0 or last or do_eval:
                record = {
                    "step": step,
                    "loss": loss_value,
                    "loss_mean": sum(window) / len(window),
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens": tokens,
                    "tokens_per_s": config.global_batch_size
                    * config.seq_len
                    * len(window)
                    / max(window_time, 1e-9),
                    "step_time_s": window_time / len(window),
                    "elapsed_s": elapsed_before + (time.perf_counter() - t_start),
                    "loss_spikes": spikes.count,
                }
                record.update(probe.collect(device))
                if device.type == "cuda":
                    record["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                if do_eval:
                    val = _evaluate(core, eval_list, micro, device, config.dtype)
                    record["val_loss"] = val
                    val_losses[step] = val
                record.update(state_.metrics)
                logger.log(record)
                window, window_time = [], 0.0
            save_now = (config.checkpoint_every and step % config.checkpoint_every == 0) or last
            if save_now and step != last_saved_step:
                last_checkpoint = save(step)
                last_saved_step = step
                bar.write(f"step {step}: checkpoint {last_checkpoint}")
            if stopped is not None:
                bar.write(f"step {step}: stopped by {stopped}; checkpoint {last_checkpoint}")
                break
    finally:
        signals.restore()
        bar.close()
        logger.close()
        probe.remove()

    return TrainResult(
        out_dir=out,
        checkpoint=last_checkpoint,
        step=step,
        losses=losses,
        val_losses=val_losses,
        final=record,
        num_parameters=num_parameters,
        model_config=model_config,
        tokens=tokens,
        elapsed_s=elapsed_before + (time.perf_counter() - t_start),
        stopped=stopped,
        trainable_parameters=num_trainable,
    )


def _factory_model(
    factory: Callable[[], nn.Module], checkpoint: Path | None, device: torch.device, vocab: int
) -> nn.Module:
    """Build a ``model_factory`` model, load a checkpoint's state into it, move it."""
    from safetensors.torch import load_file

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
    if checkpoint is not None:
        state = load_file(str(checkpoint / FACTORY_STATE_NAME))
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as error:
            raise ConfigError(
                "resume", f"the checkpoint {checkpoint} does not fit the model: {error}"
            ) from None
    return model.to(device)


def _save_factory_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    trainer_state: dict[str, Any],
    config_yaml: str,
    tokenizer_dir: Path | None,
    keep_last: int | None,
) -> Path:
    """A checkpoint of a ``model_factory`` run: the full ``state_dict()`` (parameters and
    persistent buffers, tied tensors stored once per name) as safetensors, the trainer state,
    the config and the tokenizer files, written atomically like the preset runs'."""
    import json
    import shutil

    from safetensors.torch import save_file

    final = root / ckpt.checkpoint_name(step)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    with ckpt.atomic_checkpoint_dir(final) as tmp:
        save_file(state, str(tmp / FACTORY_STATE_NAME))
        marker = {"model_class": type(model).__name__, "step": step, "tensors": len(state)}
        (tmp / FACTORY_MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        torch.save(
            ckpt.to_safe({"format": ckpt.FORMAT_VERSION, **trainer_state}),
            tmp / ckpt.TRAINER_STATE_NAME,
        )
        (tmp / ckpt.CONFIG_YAML_NAME).write_text(config_yaml, encoding="utf-8")
        if tokenizer_dir is not None:
            for file in sorted(Path(tokenizer_dir).iterdir()):
                if file.is_file() and not (tmp / file.name).exists():
                    shutil.copy2(file, tmp / file.name)
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
    with ckpt.atomic_checkpoint_dir(directory) as tmp:
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


def _next_batch(batches: Iterable[torch.Tensor], step: int) -> torch.Tensor:
    try:
        return next(batches)
    except StopIteration:
        raise RuntimeError(f"the training data ran out at step {step}") from None


@torch.no_grad()
def _evaluate(
    model: nn.Module,
    batches: list[torch.Tensor],
    micro: int,
    device: torch.device,
    dtype: str,
) -> float:
    """Mean validation loss over every rank's rows of the fixed validation batches (each rank
    holds the same number of rows, run in chunks of the micro batch size)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in batches:
        for chunk in batch.to(device).split(micro):
            with _autocast(device, dtype):
                loss = model(chunk, labels=chunk).loss
            totals[0] += loss.double() * chunk.shape[0]
            totals[1] += chunk.shape[0]
    distributed.all_reduce_sum(totals)
    model.train(was_training)
    return float(totals[0] / totals[1])
