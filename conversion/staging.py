"""The temporary folder a conversion writes into, and how it ends: moved into place whole, or gone.

A conversion writes `DST` as ``.{DST}.partial-{pid}-{id}`` beside it and renames it into place
only when complete. It is removed when the conversion fails, is interrupted (Ctrl-C), or is
stopped by SIGTERM or SIGHUP (what `timeout`, Slurm and Kubernetes send): :func:`stopping_signals`
turns those into an exception for the duration, so the same cleanup runs. SIGKILL leaves the folder
behind; the next conversion to the same DST removes every partial folder whose process is gone
(:func:`remove_stale_partials`), and refuses to start while another live process writes one.

:func:`publish` without `replace` never replaces anything at DST, even a DST that appears (empty
or not) while the conversion runs: the rename is ``renameat2(RENAME_NOREPLACE)`` where the system
has it, otherwise DST is claimed with ``mkdir`` (which fails if anything is there) and the claimed,
still empty folder is what the rename replaces. Folders are only ever removed by the code that
created them (:func:`make_parents` / :func:`remove_created`), or as stale partial folders.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
import re
import shutil
import signal
import threading
import uuid
from pathlib import Path

from ..modeling.checkpoint_names_deepseek_v41_vl import DeepseekV41ConversionError

_PARTIAL = re.compile(r"\.(?P<name>.+)\.(?:partial|replaced)-(?:(?P<pid>\d+)-)?[0-9a-f]{12}$")
# the signals that stop a conversion as Ctrl-C does (SIGHUP is missing on Windows)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def partial_folder(dst: Path) -> Path:
    """A fresh name for the folder a conversion to `dst` writes into (beside it, hidden)."""
    return dst.parent / f".{dst.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_partials(dst: Path) -> list[Path]:
    """Remove the partial / replaced folders earlier conversions to `dst` left behind (a process
    killed with SIGKILL cannot clean up). Folders of this package's older versions (no pid in the
    name) count as stale.

    Returns:
        The folders removed.

    Raises:
        DeepseekV41ConversionError: a partial folder of `dst` belongs to a live process (another
            conversion to the same destination is running, or its pid was reused: then remove the
            folder by hand).
    """
    if not dst.parent.is_dir():
        return []
    removed = []
    for path in sorted(dst.parent.iterdir()):
        match = _PARTIAL.match(path.name)
        if match is None or match["name"] != dst.name:
            continue
        pid = match["pid"]
        if pid is not None and int(pid) != os.getpid() and _alive(int(pid)):
            raise DeepseekV41ConversionError(
                f"{path} belongs to process {pid}, which is running: another conversion to {dst} seems to be "
                "in progress (if not, remove that folder)"
            )
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


class ConversionStopped(SystemExit):
    """A conversion stopped by SIGTERM / SIGHUP: exits with 128 + the signal number, after the
    partial folder is removed."""


@contextlib.contextmanager
def stopping_signals():
    """Inside the block, SIGTERM and SIGHUP raise :class:`ConversionStopped` (so ``except
    BaseException`` cleanup runs) instead of ending the process on the spot. A no-op outside the
    main thread, where Python cannot set signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise ConversionStopped(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def move_into_place(tmp: Path, dst: Path) -> None:
    """Rename `tmp` to `dst`, replacing an existing `dst` only once `tmp` is in place (the old one
    is put back if the rename fails)."""
    old = None
    if dst.exists() or dst.is_symlink():
        old = dst.parent / f".{dst.name}.replaced-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        if old is not None:
            os.rename(old, dst)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)


def _renameat2():
    """libc's ``renameat2`` (Linux, glibc 2.28+), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _rename_noreplace_syscall(src: Path, dst: Path) -> bool:
    """``renameat2(src, dst, RENAME_NOREPLACE)``. False where the system or file system lacks it.

    Raises:
        OSError: the rename failed (FileExistsError: something is at `dst`).
    """
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(src), None, str(dst))


def _rename_onto_claim(src: Path, dst: Path) -> None:
    """Claim `dst` with ``mkdir`` (fails if anything is there), then rename `src` onto the claimed
    empty folder. If someone wrote into the claim meanwhile, the rename fails and their files stay.

    Raises:
        OSError: FileExistsError when `dst` exists or was written into; other rename failures.
    """
    os.mkdir(dst)
    try:
        os.rename(src, dst)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.rmdir(dst)  # only while it is still the empty folder claimed above
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst)) from None
        raise


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` unless something (a file, a link, an empty or full folder) is at `dst`.

    Raises:
        FileExistsError: something is at `dst`; nothing was changed there.
        OSError: any other failure of the rename.
    """
    if not _rename_noreplace_syscall(src, dst):
        _rename_onto_claim(src, dst)


def publish(tmp: Path, dst: Path, replace: bool) -> None:
    """Move the finished folder `tmp` to `dst`.

    Args:
        replace: replace whatever is at `dst` (``--force``: :func:`move_into_place`). Without it
            nothing at `dst` is ever replaced, even what appeared there after the run started.

    Raises:
        DeepseekV41ConversionError: `replace` is False and `dst` exists (`tmp` is left for the
            caller to remove).
        OSError: the rename failed otherwise.
    """
    if replace:
        move_into_place(tmp, dst)
        return
    try:
        rename_noreplace(tmp, dst)
    except FileExistsError:
        raise DeepseekV41ConversionError(
            f"destination {dst} appeared while the conversion ran; it is left as it is and nothing was "
            "written there (pass --force (force=True) to replace it)"
        ) from None


def make_parents(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents (like ``mkdir -p``).

    Returns:
        The folders created, outermost first (for :func:`remove_created`).

    Raises:
        OSError: a folder cannot be created (a file in the way, no permission, ...); the folders
            created before the failure are removed again.
    """
    missing = []
    probe = folder
    while not probe.is_dir():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    created: list[Path] = []
    try:
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:
                if not path.is_dir():
                    raise NotADirectoryError(errno.ENOTDIR, "a file is where a folder must go", str(path)) from None
                continue  # made by someone else meanwhile: not ours to remove
            created.append(path)
    except OSError:
        remove_created(created)
        raise
    return created


def remove_created(created: list[Path]) -> None:
    """Remove the folders :func:`make_parents` created, innermost first, where still empty (what
    anyone else put into them since stays, with the folders holding it)."""
    for path in reversed(created):
        with contextlib.suppress(OSError):
            os.rmdir(path)


__all__ = [
    "ConversionStopped",
    "STOP_SIGNALS",
    "make_parents",
    "move_into_place",
    "partial_folder",
    "publish",
    "remove_created",
    "remove_stale_partials",
    "rename_noreplace",
    "stopping_signals",
]


@contextlib.contextmanager
def staged_folder(dst: Path, what: str):
    """The one staging sequence of the converter and ``make-tiny``: make DST's missing parents,
    remove partial folders of dead runs, create a fresh partial folder beside DST and yield
    ``(tmp, removed_partials)``; the caller fills `tmp` and `publish`es it. On any failure inside,
    `tmp` and the parents this call made are removed (never anything else).

    Args:
        what: the failing step for the message, e.g. ``"converting into"``.

    Raises:
        DeepseekV41ConversionError: an OSError inside (``"{what} {dst} failed: ..."``), or another
            run of the same DST in progress (:func:`remove_stale_partials`).
    """
    created, tmp = [], None
    try:
        created = make_parents(dst.parent)
        removed = remove_stale_partials(dst)
        candidate = partial_folder(dst)
        candidate.mkdir()
        tmp = candidate  # ours from here on: removed on any failure
        yield tmp, removed
    except BaseException as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_created(created)
        if isinstance(exc, OSError):
            raise DeepseekV41ConversionError(f"{what} {dst} failed: {exc}") from None
        raise

