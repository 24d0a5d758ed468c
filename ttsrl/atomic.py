"""Atomic writes: a file or folder appears whole, or not at all (temp + rename).

Every writer of the package goes through here, with one durability policy: the new
file's data is flushed to disk (``fsync``) before it replaces the old one, and the
folder is synced after the rename, so a power cut leaves the old file or the new
one, never a torn or empty one. Temporary names carry the writer's pid
(``.NAME.tmp-PID-XXXX``) so that :func:`remove_stale_temps` can delete what a
killed writer (``kill -9``) left behind, without touching a live writer's file.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_TEMP_RE = re.compile(r"^\..+\.(?:tmp|old)-(\d+)-")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks (integrity records of written files)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: str | Path) -> None:
    """Flush a file or folder to disk (folders: where the filesystem allows it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot sync directories
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temps(folder: str | Path) -> list[Path]:
    """Delete temporary files/folders in ``folder`` left by writers that no longer run."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        m = _TEMP_RE.match(p.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path in ``path``'s folder to write to (with any writer: torch.save,
    savefig, wave, a ParquetWriter...); on success it is synced and replaces ``path``,
    on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.tmp-{os.getpid()}-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; give it normal modes
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(obj, path: str | Path) -> None:
    """``torch.save`` under this module's policy (torch is imported only here)."""
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


@contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temp folder next to ``target``; on success its files are synced and it
    replaces ``target`` (an existing one, folder or file, is moved aside, then deleted),
    on error it is removed. Callers decide whether ``target`` may be replaced at all."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private
        for p in tmp.rglob("*"):
            if p.is_file() and not p.is_symlink():
                fsync_path(p)
        fsync_path(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}-")
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_path(target.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:  # a file or a link: rmtree would leave it behind as .NAME.old-PID
            old.unlink(missing_ok=True)


def check_output_file(out: str | Path, inputs: tuple = (), force: bool = False, flag: str = "--out") -> None:
    """Refuse to write ``out`` over something the user did not ask to replace: an
    input of the same run (never, even with ``force``: a hard link or a symlink to it
    counts), a folder, or any existing file unless ``force``. Raises ``ValueError``
    with a message naming the file and the way out."""
    out = Path(out)
    for src in inputs:
        if src is None:
            continue
        src = Path(src)
        same = (out.exists() and src.exists() and os.path.samefile(out, src)) or out.resolve() == src.resolve()
        if same:
            raise ValueError(f"{flag} {out} is the input file {src}: writing it would destroy the input; "
                             f"choose another {flag}")
    if out.is_dir():
        raise ValueError(f"{flag} {out} is a folder; give a file path")
    if out.exists() and not force:
        raise ValueError(f"{flag} {out} exists; pass --force to replace it, or choose another {flag}")
