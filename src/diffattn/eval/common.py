"""What every ``diffattn eval`` experiment shares: models, tokenizers, seeds, progress and the
output directory.

* Models (:func:`load_models`): ``MODEL`` is anything :mod:`diffattn.loading` resolves (a
  diffattn directory; a Hugging Face Llama, Qwen2, Mistral or DiffLlama directory; the SmolLM2
  GGUF; a Dex adapter or run directory); ``--dex ADAPTER`` applies a Dex adapter to it first;
  ``--compare MODEL2 ...`` adds models evaluated the same way, side by side.
* Output (:func:`write_outputs`): ``--out DIR`` receives ``results.json`` (the figures plus the
  models, data fingerprint, seed, command and library version), ``report.md`` and PNG figures.
* Runs are seeded (:func:`seed_everything`) and long loops show progress (:func:`progress`).
* A command is its settings, ``run``, report and figures (:func:`command_main`); figures are
  drawn on :func:`one_axes` or a :func:`panel_row` and written by :func:`save_axes` or
  :func:`save_figure`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import platform
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from diffattn.loading import TextTokenizer
from diffattn.settings import Settings, setting

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_DTYPE = "fp32"
"""The dtype models are evaluated in unless ``--dtype`` says otherwise."""
RESULTS_NAME = "results.json"
REPORT_NAME = "report.md"


@dataclass
class EvalModel:
    """One model under evaluation.

    Attributes:
        name: a short label for tables and figures (unique among the models of a run).
        spec: what was passed on the command line.
        model: the model in eval mode on its device.
        tokenizer: its tokenizer (``None`` when none is stored with it).
        kind: ``diffattn``, ``hf``, ``gguf`` or ``dex``.
        attention: ``baseline``, ``diff_v1``, ``diff_v2`` for diffattn models, else the
            Hugging Face ``model_type`` (with ``+dex`` when Dex is applied).
        document_eos: the EOS id after which a new document begins in a window, for a model
            whose run trained with ``document_masking`` (its recipe says so); ``None``: the
            windows attend across documents, as the model trained.
    """

    name: str
    spec: str
    model: nn.Module
    tokenizer: TextTokenizer | None
    kind: str
    attention: str
    extra: dict[str, Any] = field(default_factory=dict)
    document_eos: int | None = None

    def window_inputs(self, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The forward arguments of right-padded windows ``ids``: the tokens and the padding
        mask, and the documents (split after each EOS) for a model trained with
        ``document_masking``, so a window attends as the model trained."""
        inputs = {"input_ids": ids, "attention_mask": mask}
        if self.document_eos is not None:
            from diffattn.data import documents_after_eos

            inputs["document_ids"] = documents_after_eos(ids, self.document_eos)
        return inputs

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "spec": self.spec,
            "kind": self.kind,
            "attention": self.attention,
            "parameters": self.n_params,
        }


def _attention_of(model: nn.Module, kind: str) -> str:
    config = getattr(model, "config", None)
    attention = getattr(config, "attention", None) or getattr(config, "model_type", "unknown")
    return f"{attention}+dex" if kind == "dex" else str(attention)


def _unique_names(specs: Sequence[str]) -> list[str]:
    """Short distinct labels: the path components that differ between the specs (shared leading
    and trailing components dropped), e.g. ``runs/baseline-seed0/checkpoints/step-250`` and
    ``runs/diff_v1-seed0/checkpoints/step-250`` become ``baseline-seed0`` and ``diff_v1-seed0``."""
    parts = [[p for p in Path(spec).parts if p not in ("/", ".")] or [spec] for spec in specs]
    if len(parts) == 1:
        return [parts[0][-1]]
    shortest = min(len(p) for p in parts)
    lead = 0
    while lead < shortest - 1 and len({p[lead] for p in parts}) == 1:
        lead += 1
    trail = 0
    while trail < shortest - lead - 1 and len({p[-1 - trail] for p in parts}) == 1:
        trail += 1
    names: list[str] = []
    for p in parts:
        name = "/".join(p[lead : len(p) - trail]) or p[-1]
        while name in names:
            name += "'"
        names.append(name)
    return names


def load_models(
    specs: Sequence[str],
    dex: str | None = None,
    device: str = "cpu",
    dtype: str = DEFAULT_DTYPE,
) -> list[EvalModel]:
    """Load every model of ``specs`` (the first gets ``dex`` applied when given)."""
    from diffattn.loading import load_model_and_tokenizer

    if not specs:
        raise ValueError("no model given")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    device = resolve_device(device)
    models = []
    for i, (spec, name) in enumerate(zip(specs, _unique_names(specs), strict=True)):
        if i == 0 and dex is not None:
            model, tokenizer, source = load_model_and_tokenizer(
                dex, device=device, dtype=DTYPES[dtype], base=spec
            )
            name = f"{name}+dex"
        else:
            model, tokenizer, source = load_model_and_tokenizer(
                spec, device=device, dtype=DTYPES[dtype]
            )
        wrapped = TextTokenizer(tokenizer) if tokenizer is not None else None
        models.append(
            EvalModel(
                name,
                str(spec),
                model.eval(),
                wrapped,
                source.kind,
                _attention_of(model, source.kind),
                document_eos=_document_eos(spec, wrapped),
            )
        )
    return models


def _document_eos(spec: str, tokenizer: TextTokenizer | None) -> int | None:
    """The EOS id that ends documents in ``spec``'s windows when its run trained with
    ``document_masking`` (:mod:`diffattn.eval.run_split`), else ``None``."""
    from diffattn.eval.run_split import recipe_of, run_split

    recipe = recipe_of(spec)
    if recipe is None or not run_split(recipe).document_masking:
        return None
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None:
        raise ValueError(
            f"{spec} trained with document_masking, but no tokenizer with an EOS token is "
            "stored with it: its documents cannot be told apart"
        )
    return int(eos)


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when available, else ``cpu``; ``cuda`` without CUDA is an error."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be cpu, cuda or auto, got {device!r}")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass


def progress(
    iterable: Iterable, total: int | None = None, desc: str = "", quiet: bool = False
) -> Iterator:
    """``iterable`` with a progress bar on stderr (tqdm when installed and not quiet)."""
    if quiet:
        yield from iterable
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield from iterable
        return
    yield from tqdm(
        iterable, total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True
    )


def fingerprint(value: Any) -> str:
    """A short sha256 of ``value`` (tensors by their bytes, the rest as JSON)."""
    digest = hashlib.sha256()
    if isinstance(value, torch.Tensor):
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    else:
        digest.update(json.dumps(value, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def _plain(value: Any) -> Any:
    """JSON-ready copy: tensors to lists, non-finite floats to None, paths to strings."""
    if isinstance(value, torch.Tensor):
        return _plain(value.detach().cpu().tolist())
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_outputs(
    out: str | os.PathLike,
    experiment: str,
    results: dict[str, Any],
    models: Sequence[EvalModel],
    report: str,
    settings: dict[str, Any],
    data_fingerprint: str | None = None,
    figures: Sequence[Path] = (),
    data_from: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Write ``results.json`` and ``report.md`` into ``out`` (figures are already there).

    ``results.json`` holds ``results`` plus the experiment, models, settings (seeds
    included), data fingerprint, where each data setting came from (``data_from``: the run's
    recipe, a flag, or the evaluation's default), command line, library and torch versions.
    """
    from diffattn.eval.run_split import report_lines
    from diffattn.version import __version__

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "experiment": experiment,
        "models": [m.describe() for m in models],
        "settings": settings,
        "data_from": data_from,
        "data_fingerprint": data_fingerprint,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "diffattn_version": __version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "figures": [Path(f).name for f in figures],
        "results": results,
    }
    tmp = out / f".{RESULTS_NAME}.tmp"
    tmp.write_text(json.dumps(_plain(record), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / RESULTS_NAME)
    header = (
        f"# diffattn eval {experiment}\n\n"
        f"Command: `{record['command']}`  \n"
        f"diffattn {__version__}, torch {torch.__version__}; data fingerprint "
        f"`{data_fingerprint}`; settings `{json.dumps(_plain(settings), sort_keys=True)}`\n\n"
        "| model | kind | attention | parameters |\n|---|---|---|---|\n"
        + "".join(f"| {m.name} | {m.kind} | {m.attention} | {m.n_params:,} |\n" for m in models)
        + "\n"
        + (report_lines(data_from) if data_from else "")
    )
    figure_lines = "".join(f"\n![{Path(f).stem}]({Path(f).name})\n" for f in figures)
    (out / REPORT_NAME).write_text(header + report.rstrip() + "\n" + figure_lines, "utf-8")
    return out / RESULTS_NAME


def finish(
    args: Any,
    experiment: str,
    results: dict[str, Any],
    models: Sequence[EvalModel],
    report: str,
    settings: dict[str, Any],
    figures: Sequence[Path | None] = (),
    data_fingerprint: str | None = None,
) -> int:
    """The end of every ``diffattn eval`` command: write the outputs, print the report.
    ``figures`` that are ``None`` (not drawn) are skipped; the fingerprint defaults to
    ``results["data_fingerprint"]``."""
    figures = [f for f in figures if f is not None]
    fingerprint_value = data_fingerprint or results.get("data_fingerprint")
    path = write_outputs(
        args.out,
        experiment,
        results,
        models,
        report,
        settings,
        fingerprint_value,
        figures,
        data_from=getattr(args, "data_provenance", None),
    )
    print(report)
    print(f"wrote {path}")
    return 0


def command_main(
    args: Any,
    experiment: str,
    settings_class: type[Settings],
    run: Callable[..., dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
    draw: Callable[[dict[str, Any], Path], Sequence[Path | None]],
    fingerprint_key: str = "data_fingerprint",
) -> int:
    """The whole of a ``diffattn eval`` command: its settings from ``args``, its models,
    ``run(models, settings)``, the figures ``draw(results, out)`` makes in ``--out``, then
    :func:`finish` with ``report(results)`` and ``results[fingerprint_key]``."""
    settings = settings_class.from_args(args)
    models = models_from_args(args)
    results = run(models, settings, quiet=args.quiet)
    figures = draw(results, Path(args.out))
    settings_report = settings.report()
    fingerprint_value = results.get(fingerprint_key)
    return finish(
        args,
        experiment,
        results,
        models,
        report(results),
        settings_report,
        figures,
        fingerprint_value,
    )


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table; floats get 4 significant digits."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "—" if v != v else f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class CommonOptions(Settings):
    """The options every ``diffattn eval`` experiment has: ``MODEL``, ``--compare``, ``--dex``,
    ``--out``, ``--device``, ``--dtype``, ``--batch-size``, ``--seed`` and ``--quiet``.
    An experiment whose ``run`` takes ``batch_size`` or ``seed`` declares it with
    :func:`~diffattn.settings.shared`."""

    model: str = setting(
        positional=True,
        metavar="MODEL",
        help="diffattn or Hugging Face model directory, a .gguf file, smollm2, "
        "or a Dex adapter/run directory",
    )
    compare: tuple[str, ...] = setting(
        (), metavar="MODEL2", help="more models evaluated the same way, side by side"
    )
    dex: str | None = setting(None, metavar="ADAPTER", help="apply this Dex adapter to MODEL first")
    out: str | None = setting(None, help="output directory (default: runs/eval/<experiment>)")
    device: str = setting(
        "auto", help="cpu, cuda or auto (default: {default}: CUDA when available)"
    )
    dtype: str = setting(DEFAULT_DTYPE, choices=tuple(sorted(DTYPES)))
    batch_size: int = setting(8, help="sequences per forward", min=1)
    seed: int = setting(0)
    quiet: bool = setting(False, help="no progress bars")


add_common_arguments = CommonOptions.add_arguments


@dataclass(frozen=True)
class EvalCommandOptions(CommonOptions):
    """:class:`CommonOptions` and ``--overwrite``, an option of ``diffattn eval`` itself (the
    experiments' ``run`` never sees it)."""

    overwrite: bool = setting(
        False, help="replace a non-empty --out holding something else", command_only=True
    )


def models_from_args(args: Any) -> list[EvalModel]:
    CommonOptions.from_args(args).check()  # --batch-size must be at least 1
    return load_models([args.model, *args.compare], args.dex, args.device, args.dtype)


def batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def require_tokenizer(model: EvalModel) -> TextTokenizer:
    if model.tokenizer is None:
        raise ValueError(
            f"{model.spec}: no tokenizer is stored with this model; this evaluation needs "
            "one to build its prompts (save the model with its tokenizer)"
        )
    return model.tokenizer


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def one_axes(figsize: tuple[float, float] = (6, 4)) -> tuple[Any, Any]:
    """A new figure with a single set of axes."""
    return pyplot().subplots(figsize=figsize)


def panel_row(count: int, title: str, figsize: tuple[float, float]) -> tuple[Any, Any]:
    """A new figure titled ``title`` with ``count`` sets of axes side by side (the figure and
    the sequence of axes)."""
    fig, axes = pyplot().subplots(1, count, figsize=figsize, squeeze=False)
    fig.suptitle(title)
    return fig, axes[0]


def save_axes(
    fig: Any,
    ax: Any,
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    grid: bool = True,
    legend_size: float | None = None,
) -> Path:
    """Label ``ax``, draw its faint grid (unless ``grid`` is false) and legend, then
    :func:`save_figure`."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if grid:
        ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    return save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out, write and close ``fig``."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """One JSON object per non-blank line (``.gz`` files decompressed)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as lines:
        for number, row in json_lines(
            lines, lambda number, msg: f"{path}: line {number} is not JSON ({msg})"
        ):
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {number} is not a JSON object")
            rows.append(row)
    return rows


def json_lines(
    lines: Iterable[str], not_json: Callable[[int, str], str]
) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of each non-blank line of ``lines`` read as JSON; a line that
    is not JSON raises ``ValueError(not_json(line number, the decoder's message))``."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(not_json(number, error.msg)) from error
        yield number, value
