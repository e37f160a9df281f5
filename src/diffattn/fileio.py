"""Reading and writing the files diffattn stores: atomic directories, JSON, tokenizer files.

Every directory diffattn writes (model directories, converted checkpoints, training
checkpoints, Dex merges) goes through :func:`atomic_directory`: the files are written into a
hidden temporary sibling, flushed to disk, and renamed into place only when complete. All
temporary entries are named ``.<name>.tmp-<random>`` (the previous directory, while it is
being replaced, ``.<name>.tmp-old-<random>``), so one rule recognises every partial write,
including one nested inside another's temporary directory (``..<name>.tmp-<a>.tmp-<b>``):
:func:`is_partial_write`. :func:`remove_partial_writes` clears what a crash (even
``kill -9``) left behind. What such a directory holds gets the permissions ``open`` and
``mkdir`` give under the umask, also where a writer made a file private
(:func:`give_usual_permissions`).

This module depends on the standard library only, so every layer can use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TEMP_MARKER = ".tmp-"
"""Every temporary entry written by :func:`atomic_directory` is hidden and holds this."""
OLD_MARKER = f"{TEMP_MARKER}old-"
"""The marker of a directory that is being replaced (it holds the previous version)."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
"""The files that make up a saved tokenizer (and its generation defaults) beside a model."""


class CheckpointError(ValueError):
    """A model directory or stored file that cannot be read or written as asked; the message
    names the file and says why."""


# ----------------------------------------------------------------------------------------
# JSON
def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object stored in ``path``.

    A missing or unreadable file, malformed JSON (with its line and column) or a value that
    is not an object raises one :class:`CheckpointError` naming the file.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: cannot be read ({error})") from error
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise CheckpointError(
            f"{path}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as indented, key-sorted JSON with a trailing newline."""
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------
# tokenizer files
def copy_tokenizer_files(
    source: str | os.PathLike, target: str | os.PathLike, overwrite: bool = False
) -> list[str]:
    """Copy the :data:`TOKENIZER_FILES` present in ``source`` into ``target``; returns the
    names copied. Files ``target`` already has are kept unless ``overwrite``."""
    source, target = Path(source), Path(target)
    copied = []
    if not source.is_dir():
        return copied
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and (overwrite or not (target / name).exists()):
            shutil.copyfile(source / name, target / name)
            copied.append(name)
    return copied


# ----------------------------------------------------------------------------------------
# permissions
def current_umask() -> int:
    """This process's umask: read from ``/proc/self/status`` where the platform has it, else
    by setting a restrictive one for an instant and restoring it."""
    with contextlib.suppress(OSError, ValueError):
        status = Path("/proc/self/status").read_text(encoding="utf-8", errors="replace")
        for line in status.splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def give_usual_permissions(path: str | os.PathLike, mode: int | None = None) -> None:
    """Give ``path`` the permissions ``open`` or ``mkdir`` would have given it: ``mode``,
    by default ``0o666`` less the umask for a file and ``0o777`` less it for a directory.

    Some writers create files readable by their owner only (``tempfile.mkstemp``, and
    safetensors' ``save_file``, which writes through such a file); the permissions are only
    widened to ``mode``, never narrowed. An entry this user does not own (a shard another
    user's process wrote) is left as it is.
    """
    current = os.stat(path).st_mode
    if mode is None:
        mode = (0o777 if stat.S_ISDIR(current) else 0o666) & ~current_umask()
    if stat.S_IMODE(current) & mode != mode:
        with contextlib.suppress(PermissionError):
            os.chmod(path, stat.S_IMODE(current) | mode)


# ----------------------------------------------------------------------------------------
# atomic directories
def is_partial_write(name: str) -> bool:
    """True for the name of a temporary entry left by :func:`atomic_directory`."""
    return name.startswith(".") and TEMP_MARKER in name


def _temp_prefix(final: Path) -> str:
    return f".{final.name}{TEMP_MARKER}"


def _fsync_tree(directory: Path) -> None:
    """Give every entry of ``directory`` the usual permissions (:func:`give_usual_permissions`)
    and flush its files to disk."""
    umask = current_umask()
    for path in sorted(directory.rglob("*")):
        if path.is_symlink():
            continue
        if path.is_dir():
            give_usual_permissions(path, 0o777 & ~umask)
        elif path.is_file():
            give_usual_permissions(path, 0o666 & ~umask)
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_directory(directory)


def fsync_directory(directory: str | os.PathLike) -> None:
    """Flush a directory entry (a rename inside it) to disk where the platform allows."""
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_output_directory(
    out: str | os.PathLike,
    overwrite: bool = False,
    *,
    own: bool = False,
    option: str = "",
    hint: str = "pass overwrite=True to replace it",
) -> bool:
    """Apply the output-directory rule to ``out`` before anything is written there.

    The rule, shared by every command that writes a directory:

    * an ``out`` that does not exist, or an empty directory, is used;
    * an ``out`` that exists and is not a directory is refused;
    * a non-empty directory is used as it is only when ``own`` (the caller recognised the
      marker its own run wrote there: the same resolved settings, a checkpoint to resume);
    * any other non-empty directory is refused unless ``overwrite``, and then the caller
      replaces it as a whole (:func:`clear_output_directory` or :func:`atomic_directory`),
      so nothing of the previous contents survives.

    Returns True when ``out`` holds contents that are to be replaced (``overwrite`` of a
    non-empty directory that is not ``own``). Refusals raise one :class:`CheckpointError`
    that starts with ``option`` (e.g. ``"--out"``) and ends with ``hint``.
    """
    out = Path(out)
    where = f"{option} {out}" if option else str(out)
    if not out.exists() and not out.is_symlink():
        return False
    if not out.is_dir():
        raise CheckpointError(f"{where}: exists and is not a directory")
    if not any(out.iterdir()) or own:
        return False
    if overwrite:
        return True
    raise CheckpointError(f"{where}: directory exists and is not empty; {hint}")


def clear_output_directory(out: str | os.PathLike) -> Path:
    """Replace the directory ``out`` by an empty one, leaving nothing of its contents.

    The old directory is first renamed into a hidden temporary sibling (a name
    :func:`is_partial_write` recognises, so a crash leaves only a removable leftover) and
    then deleted; ``out`` is an empty directory afterwards. Returns ``out``.
    """
    out = Path(out)
    if out.is_dir() and not out.is_symlink():
        holder = Path(tempfile.mkdtemp(prefix=_temp_prefix(out), dir=out.parent))
        os.replace(out, holder / out.name)
        shutil.rmtree(holder, ignore_errors=True)
    elif out.exists() or out.is_symlink():
        raise CheckpointError(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    fsync_directory(out.parent)
    return out


def use_plan_directory(
    out: str | os.PathLike, plan_name: str, plan: str, overwrite: bool, what: str
) -> Path:
    """Apply :func:`check_output_directory` to a directory that a sweep of runs owns through
    its resolved plan ``out/plan_name`` (text): ``out`` is used when absent, empty or holding
    this same plan, else refused unless ``overwrite`` (then replaced whole). The plan is
    written (atomically) and ``out`` returned. ``what`` names the sweep in the refusal."""
    out = Path(out)
    plan_file = out / plan_name
    same = plan_file.is_file() and plan_file.read_text(encoding="utf-8") == plan
    replace = check_output_directory(
        out,
        overwrite,
        own=same and not overwrite,
        option="--out",
        hint=f"it holds other files or {what} with different settings; choose another --out "
        "or pass --overwrite to replace it",
    )
    if replace:
        clear_output_directory(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = plan_file.with_suffix(".tmp")
    tmp.write_text(plan, encoding="utf-8")
    tmp.replace(plan_file)
    return out


@contextlib.contextmanager
def atomic_directory(out_dir: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes ``out_dir`` only if the block succeeds.

    ``out_dir`` must not exist (or be empty) unless ``overwrite``; then the old directory is
    replaced only after the new one is complete. The files are flushed to disk before the
    rename, so after a crash ``out_dir`` is either the old directory or the complete new one.
    On any error nothing at ``out_dir`` changes and the temporary directory is removed.
    """
    out = Path(out_dir)
    check_output_directory(out, overwrite)
    tmp = temporary_sibling(out)
    try:
        yield tmp
        commit_directory(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def temporary_sibling(out: str | os.PathLike) -> Path:
    """A new empty directory beside ``out`` named as :func:`remove_partial_writes` removes it:
    the first phase of :func:`atomic_directory`, for writers that fill it in several
    processes (sharded checkpoints) before :func:`commit_directory`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(out), dir=out.parent))
    give_usual_permissions(tmp)  # mkdtemp makes 0700
    return tmp


def commit_directory(tmp: str | os.PathLike, out: str | os.PathLike) -> None:
    """Flush ``tmp`` to disk and rename it to ``out``, replacing an existing ``out`` only
    after the new one is complete (the second phase of :func:`atomic_directory`)."""
    tmp, out = Path(tmp), Path(out)
    _fsync_tree(tmp)
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}{OLD_MARKER}", dir=out.parent))
        os.replace(out, old / out.name)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    fsync_directory(out.parent)


def remove_partial_writes(parent: str | os.PathLike) -> list[Path]:
    """Remove every temporary entry :func:`atomic_directory` may have left in ``parent``.

    A crash between the two renames of a replacement leaves the previous directory inside
    its ``.<name>.tmp-old-*`` holder while ``<name>`` is gone: that directory is moved back
    to ``<name>`` first, so the last complete version survives. Returns the removed paths.
    """
    parent = Path(parent)
    if not parent.is_dir():
        return []
    entries = sorted(p for p in parent.iterdir() if is_partial_write(p.name))
    for path in entries:
        head, _, _ = path.name.partition(OLD_MARKER)
        name = head[1:]
        if OLD_MARKER in path.name and name and not is_partial_write(name):
            previous, final = path / name, parent / name
            if previous.is_dir() and not final.exists():
                os.replace(previous, final)
    removed = []
    for path in entries:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        removed.append(path)
    return removed
