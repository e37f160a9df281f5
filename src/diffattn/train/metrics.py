"""What a run records: ``OUT/metrics.jsonl``, λ probes, loss spikes, TensorBoard, W&B, progress.

One JSON object per logged step in ``metrics.jsonl`` (fields in ``docs/training.md``). DIFF V1
records ``lambda``: per layer the scalar λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init of Eq.2
(``DiffAttentionV1.lambda_full``). DIFF V2 records ``lambda_mean``: per layer the mean over
tokens and heads of the λ the layer applied (sigmoid(x·W_λ) in the V2 blog's formula), caught
by the capture probe (a forward hook on ``lambda_proj``) during the training forwards of the
step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from diffattn.probe import Lambda, Probe
from diffattn.train import distributed

METRICS_NAME = "metrics.jsonl"
TENSORBOARD_DIRNAME = "tensorboard"
WANDB_ID_NAME = "wandb_run_id.txt"


def _plain(value: Any) -> float:
    """A Python float from a tensor or DTensor (gathering a sharded value)."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


class LambdaProbe:
    """Per-layer λ of a model's differential layers (nothing for softmax models), for the
    metrics, as each layer's attention type declares it (``AttentionType.scalar_lambda``,
    ``token_lambda``, ``lambda_key``; a mixed stack records each layer by its own type).

    Built on the capture probe's :class:`~diffattn.probe.Lambda`: V1 reads Eq.2's λ from the
    parameters; V2 averages the token λ of the forwards run inside :meth:`capture`.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.lam = Lambda()
        self.lam.enabled = False
        self._probe = Probe(model, [self.lam]).__enter__()
        self.scalar = bool(self.lam.scalar_layers())
        self.token = bool(self.lam.token_layers())

    @property
    def key(self) -> str | None:
        """The key of the first layer's λ in the records, or ``None`` without a λ."""
        return next((v.lambda_key for v in self._probe.layers if v.lambda_key), None)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record V2's λ during the forwards inside this block (not in recomputation)."""
        self.lam.enabled = True
        try:
            yield
        finally:
            self.lam.enabled = False

    def collect(self, device: torch.device) -> dict[str, list[float]]:
        """The per-layer values since the last call, averaged over ranks. Collective."""
        values: dict[str, dict[int, float]] = {}
        views = self._probe.layers
        if self.scalar:
            scalars = iter(self.lam.scalar_lambdas())
            for view in views:
                if view.scalar_lambda is not None:
                    values.setdefault(view.lambda_key, {})[view.index] = _plain(next(scalars))
        if self.token:
            for key, found in self._token_means(device).items():
                values.setdefault(key, {}).update(found)
        return {key: self.lam.per_layer(key, found) for key, found in values.items()}

    def _token_means(self, device: torch.device) -> dict[str, dict[int, float]]:
        """The mean token λ of each layer with one since the last call, all ranks together."""
        layers = self.lam.token_layers()
        sums = torch.tensor(
            [float(self.lam.sums.get(i, 0.0)) for i in layers], device=device, dtype=torch.float64
        )
        counts = torch.tensor(
            [self.lam.counts.get(i, 0) for i in layers], device=device, dtype=torch.float64
        )
        distributed.all_reduce_sum(sums)
        distributed.all_reduce_sum(counts)
        self.lam.reset()
        means = (sums / counts.clamp_min(1)).tolist()
        keys = {v.index: v.lambda_key for v in self._probe.layers}
        out: dict[str, dict[int, float]] = {}
        for i, m, c in zip(layers, means, counts.tolist(), strict=True):
            out.setdefault(keys[i], {})[i] = m if c > 0 else math.nan
        return out

    def remove(self) -> None:
        self._probe.__exit__(None, None, None)


class SpikeDetector:
    """Counts steps whose loss exceeds ``factor`` × the median of the last ``window`` losses
    (checked once at least ``min(10, window)`` losses are known)."""

    def __init__(self, factor: float, window: int) -> None:
        self.factor = factor
        self.window = window
        self.history: deque[float] = deque(maxlen=window)
        self.count = 0

    def update(self, loss: float) -> bool:
        spike = len(self.history) >= min(10, self.window) and loss > self.factor * (
            statistics.median(self.history)
        )
        self.count += int(spike)
        self.history.append(loss)
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((float(x) for x in state["history"]), maxlen=self.window)
        self.count = int(state["count"])


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


class MetricsLogger:
    """Rank 0's sinks: ``metrics.jsonl``, optionally TensorBoard and Weights & Biases.

    On resume the JSON lines after the resumed step (written before a crash) are dropped, so
    every step appears once.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        enabled: bool = True,
        resume_step: int | None = None,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "diffattn",
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = Path(out_dir) / METRICS_NAME
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("", encoding="utf-8")
        else:
            self._truncate_after(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                str(Path(out_dir) / TENSORBOARD_DIRNAME),
                purge_step=None if resume_step is None else resume_step + 1,
            )
        if wandb:
            self._wandb = _start_wandb(Path(out_dir), wandb_project, run_name, config, resume_step)

    def _truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record, default=_json_default) + "\n")
        self._file.flush()
        step = record["step"]
        scalars = {}
        for key, value in record.items():
            if key == "step":
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                scalars[key] = value
            elif isinstance(value, list) and key.startswith("lambda"):
                for layer, item in enumerate(value):
                    scalars[f"{key}/layer_{layer:02d}"] = item
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _start_wandb(
    out_dir: Path,
    project: str,
    name: str | None,
    config: dict[str, Any] | None,
    resume_step: int | None,
):
    try:
        import wandb
    except ImportError:
        raise ImportError("wandb: true, but the wandb package is not installed") from None
    id_file = out_dir / WANDB_ID_NAME
    run_id = None
    if resume_step is not None and id_file.is_file():
        run_id = id_file.read_text(encoding="utf-8").strip() or None
    run = wandb.init(
        project=project, name=name, config=config, dir=str(out_dir), id=run_id, resume="allow"
    )
    id_file.write_text(run.id, encoding="utf-8")
    return run


def read_metrics(out_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of ``OUT/metrics.jsonl`` in order."""
    path = Path(out_dir) / METRICS_NAME
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


class Progress:
    """A tqdm bar (loss, lr, tokens/s, ETA) on rank 0; messages go above it."""

    def __init__(self, enabled: bool, total: int, initial: int) -> None:
        self.enabled = enabled
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total,
                initial=initial,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def update(self, loss: float, lr: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=False
            )
            self._bar.update(1)

    def write(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
