"""The 64K context-extension command of docs/long_context.md, at a small size on the CPU.

The GPU command (8 processes, ``cp=8``, FSDP2, 65,536 tokens, bf16) is read from the page and
run with 2 processes, ``cp=2`` and 256 tokens in fp32, everything else as written: the
recipe, ``init_from`` a checkpoint of the recipe's model, the upsampled data tokenised with
that checkpoint's tokenizer, FSDP2 and full activation checkpointing. Its losses and gradient
norms must be those of the same run in one process without context parallelism.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from extras import require_extra

pytestmark = require_extra("train")

import yaml

from diffattn.checkpoint import read_config
from diffattn.cli import main
from diffattn.train.recipe_files import read_recipe
from train_helpers import REPO, tiny_recipe, torchrun, write_recipe

PAGE = REPO / "docs" / "long_context.md"
RECIPE = REPO / "src/diffattn/recipes/long_context.yaml"
SMALL = (
    ("65536", "256"),
    ("cp=8", "cp=2"),
    ("global_batch_size=8", "global_batch_size=2"),
    ("dtype=bf16", "dtype=fp32"),
)
SHORT_RUN = ["--steps", "2", "--set", "schedule.warmup_steps=1", "--set", "eval_every=0"]
SHORT_RUN += ["--set", "log_every=1"]


def gpu_commands() -> tuple[list[str], list[str]]:
    """The page's two commands under "At the paper's 64K": upsampling, then the torchrun
    launch (its arguments after ``-m diffattn.train``), at the small size."""
    section = PAGE.read_text(encoding="utf-8").split("### At the paper's 64K", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    for old, new in SMALL:
        assert old in block, f"docs/long_context.md's 64K command no longer says {old}"
        block = block.replace(old, new)
    upsample, launch = block.replace("\\\n", " ").strip().splitlines()
    upsample, launch = shlex.split(upsample), shlex.split(launch)
    assert upsample[:3] == ["diffattn", "long-context", "upsample"], upsample
    assert launch[:3] == ["torchrun", "--nproc-per-node", "8"], launch
    return upsample[1:], launch[launch.index("diffattn.train") + 1 :]


def checkpoint_of_the_recipes_model(root: Path, data_cache) -> Path:
    """One step of training of long_context.yaml's model at its original θ and length, with a
    BPE of the model's vocabulary saved beside it (what ``diffattn compare`` leaves)."""
    model = dict(read_recipe(RECIPE)["model"])
    model.update(rope_theta=10_000.0, max_seq_len=128)
    recipe = tiny_recipe(data_cache, steps=1, seq_len=128, global_batch_size=4)
    recipe["model"] = model
    recipe["data"]["tokenizer"] = f"bpe:{model['vocab_size']}"
    path = write_recipe(root / "base.yaml", recipe)
    assert main(["train", str(path), "--out", str(root / "base"), "--quiet"]) == 0
    return sorted((root / "base" / "checkpoints").iterdir())[-1]


def _losses(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def test_the_64k_command_runs_at_a_small_size_and_equals_one_process(
    tmp_path, data_cache, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    upsample, launch = gpu_commands()
    ckpt = checkpoint_of_the_recipes_model(tmp_path, data_cache)
    launch = [a.replace("$CKPT", str(ckpt)) for a in launch]
    upsample = [a.replace("$CKPT", str(ckpt)) for a in upsample]
    assert main([*upsample, "--max-bytes", "200000"]) == 0
    assert (tmp_path / "runs/long-context/data-64k/train.jsonl").is_file()

    result = torchrun([str(REPO / launch[0]), *launch[1:], *SHORT_RUN, "--quiet"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    split = tmp_path / "runs/long-context/diff_v1-64k"

    single = [*launch, *SHORT_RUN, "--set", "parallel=none", "--set", "cp=1"]
    single[single.index("--out") + 1] = str(tmp_path / "single")
    assert main(["train", str(REPO / single[0]), *single[1:], "--quiet"]) == 0

    got, reference = _losses(split), _losses(tmp_path / "single")
    assert [r["step"] for r in got] == [r["step"] for r in reference] == [1, 2]
    for a, b in zip(reference, got, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a, b)
    ran = yaml.safe_load((split / "config.yaml").read_text())
    assert (ran["parallel"], ran["cp"], ran["activation_checkpointing"]) == ("fsdp", 2, "full")
    saved = read_config(split / "checkpoints" / "step-00000002")
    assert (saved.rope_theta, saved.max_seq_len, saved.attention) == (640_000, 256, "diff_v1")
