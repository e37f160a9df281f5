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
