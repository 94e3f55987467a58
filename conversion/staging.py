"""The temporary folder a conversion writes into, and how it ends: moved into place whole, or gone.

A conversion writes `DST` as ``.{DST}.partial-{pid}-{id}`` beside it and renames it into place
only when complete. It is removed when the conversion fails, is interrupted (Ctrl-C), or is
stopped by SIGTERM or SIGHUP (what `timeout`, Slurm and Kubernetes send): :func:`stopping_signals`
turns those into an exception for the duration, so the same cleanup runs. SIGKILL leaves the folder
behind; the next conversion to the same DST removes every partial folder whose process is gone
(:func:`remove_stale_partials`), and refuses to start while another live process writes one.
"""

from __future__ import annotations

import contextlib
import os
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


__all__ = ["ConversionStopped", "STOP_SIGNALS", "move_into_place", "partial_folder", "remove_stale_partials", "stopping_signals"]
