"""Atomic directories, the clean-up of what a crash leaves, JSON reading, tokenizer files."""

from __future__ import annotations

import pytest

from diffattn.fileio import (
    TOKENIZER_FILES,
    CheckpointError,
    atomic_directory,
    copy_tokenizer_files,
    is_partial_write,
    read_json,
    remove_partial_writes,
)


def write_old(parent):
    old = parent / "step-00000010"
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(b"old weights")
    return old


def test_crash_inside_the_block_keeps_the_old_directory_and_leaves_no_temp(tmp_path):
    old = write_old(tmp_path)
    with pytest.raises(RuntimeError), atomic_directory(old, overwrite=True) as tmp:
        assert is_partial_write(tmp.name) and tmp.parent == tmp_path
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")
    assert (old / "model.safetensors").read_bytes() == b"old weights"
    assert [p.name for p in tmp_path.iterdir()] == [old.name]


def test_start_up_clean_up_removes_every_temp_name_the_writer_uses(tmp_path):
    """What ``kill -9`` can leave: the new directory being written (also one nested inside
    another writer's temp directory), an empty holder for the old one, and stray files."""
    old = write_old(tmp_path)
    leftovers = [
        f".{old.name}.tmp-a1b2c3",  # the new directory, half written
        f"..{old.name}.tmp-a1b2c3.tmp-d4e5f6",  # a writer nested inside another's temp dir
        f".{old.name}.tmp-old-g7h8i9",  # the holder of the previous version, still empty
        ".step-00000020.tmp-j1k2l3",  # another checkpoint that never finished
    ]
    for name in leftovers:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 1024)
    (tmp_path / ".step-00000030.tmp-file").write_bytes(b"partial file")
    removed = remove_partial_writes(tmp_path)
    assert sorted(p.name for p in removed) == sorted([*leftovers, ".step-00000030.tmp-file"])
    assert [p.name for p in tmp_path.iterdir()] == [old.name]
    assert (old / "model.safetensors").read_bytes() == b"old weights"


def test_clean_up_restores_a_directory_caught_between_the_two_renames(tmp_path):
    old = write_old(tmp_path)
    holder = tmp_path / f".{old.name}.tmp-old-x1y2z3"
    holder.mkdir()
    old.rename(holder / old.name)  # the crash came before the new directory was renamed in
    (tmp_path / f".{old.name}.tmp-n1m2").mkdir()
    remove_partial_writes(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [old.name]
    assert (old / "model.safetensors").read_bytes() == b"old weights"


def test_successful_replacement_leaves_only_the_new_directory(tmp_path):
    old = write_old(tmp_path)
    with atomic_directory(old, overwrite=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"new weights")
    assert (old / "model.safetensors").read_bytes() == b"new weights"
    assert [p.name for p in tmp_path.iterdir()] == [old.name]
    assert remove_partial_writes(tmp_path) == []
    assert remove_partial_writes(tmp_path / "absent") == []


def test_refuses_a_non_empty_directory_without_overwrite(tmp_path):
    old = write_old(tmp_path)
    with pytest.raises(CheckpointError, match="not empty"), atomic_directory(old):
        pass
    (tmp_path / "file").write_text("x")
    with (
        pytest.raises(CheckpointError, match="not a directory"),
        atomic_directory(tmp_path / "file"),
    ):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", old.name]


def test_read_json_names_the_file_and_line(tmp_path):
    good = tmp_path / "good.json"
    good.write_text('{"a": 1}')
    assert read_json(good) == {"a": 1}
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "a": 1,\n  oops\n}')
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON \(line 3, column 3"):
        read_json(bad)
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    with pytest.raises(CheckpointError, match=r"list\.json: expected a JSON object"):
        read_json(listed)
    with pytest.raises(CheckpointError, match=r"missing\.json: cannot be read"):
        read_json(tmp_path / "missing.json")


def test_copy_tokenizer_files_copies_only_tokenizer_files(tmp_path):
    source, target = tmp_path / "src", tmp_path / "dst"
    source.mkdir()
    target.mkdir()
    for name in ("tokenizer.json", "merges.txt", "model.safetensors"):
        (source / name).write_text(name)
    (target / "merges.txt").write_text("kept")
    assert copy_tokenizer_files(source, target) == ["tokenizer.json"]
    assert (target / "merges.txt").read_text() == "kept"
    assert not (target / "model.safetensors").exists()
    assert copy_tokenizer_files(source, target, overwrite=True) == ["tokenizer.json", "merges.txt"]
    assert (target / "merges.txt").read_text() == "merges.txt"
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(
        TOKENIZER_FILES
    )


# ----------------------------------------------------------------------------------------
# permissions
@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    """The umask the test writes under (restored afterwards)."""
    import os

    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _modes(directory) -> dict[str, int]:
    import stat

    return {
        str(p.relative_to(directory)): stat.S_IMODE(p.stat().st_mode)
        for p in [directory, *directory.rglob("*")]
    }


def _usual(directory, umask: int) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): (0o777 if p.is_dir() else 0o666) & ~umask
        for p in [directory, *directory.rglob("*")]
    }


def test_an_atomic_directory_holds_no_private_files(tmp_path, umask):
    """Writers that make files private (mkstemp, safetensors' save_file) are given the usual
    permissions on commit."""
    import os
    import tempfile

    import torch
    from safetensors.torch import save_file

    with atomic_directory(tmp_path / "out") as tmp:
        save_file({"x": torch.zeros(2)}, str(tmp / "model.safetensors"))
        os.close(tempfile.mkstemp(dir=tmp)[0])
        (tmp / "config.json").write_text("{}", encoding="utf-8")
        tempfile.mkdtemp(dir=tmp)
    out = tmp_path / "out"
    assert _modes(out) == _usual(out, umask)


def test_model_directories_and_training_checkpoints_are_not_private(tmp_path, umask):
    import torch

    from diffattn.checkpoint import save_model
    from diffattn.train.checkpoint import save_checkpoint
    from helpers import tiny_diffattn

    model = tiny_diffattn("diff_v1")
    saved = save_model(model, tmp_path / "model")
    assert _modes(saved) == _usual(saved, umask)
    step = save_checkpoint(
        tmp_path / "run" / "checkpoints", 1, model.config, model.state_dict(), {"step": 1}, ""
    )
    assert _modes(step) == _usual(step, umask)
    assert (step / "model.safetensors").is_file() and torch.load(
        step / "trainer_state.pt", weights_only=True
    )


def test_token_shards_and_dex_adapters_are_not_private(tmp_path, umask):
    from diffattn import dex
    from diffattn.data.shards import ShardWriter
    from helpers import tiny_diffattn

    writer = ShardWriter(tmp_path / "shards", vocab_size=10, eos_id=0, tokenizer_name="t")
    writer.add([1, 2, 3])
    writer.close()
    assert _modes(tmp_path / "shards") == _usual(tmp_path / "shards", umask)
    model = tiny_diffattn("baseline")
    dex.apply(model, "all", anneal_steps=0)
    adapter = dex.save_adapter(model, tmp_path / "adapter")
    assert _modes(adapter) == _usual(adapter, umask)
