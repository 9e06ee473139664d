"""The JSONL report file (``KVCANARY_REPORT``): open, append whole lines, notice a removed or replaced file.

``ReportFile`` only moves bytes; what a failure means (log mode: log, count, drop; raise mode: raise) is the
``Reporter``'s policy (``kvcanary.report``). Rules:

* Start-up: ``open()`` checks the path (``kvcanary.settings.check_report_path``), creates missing parent directories and
  opens with ``O_WRONLY | O_APPEND | O_CREAT``; any failure is a ``ValueError`` naming ``KVCANARY_REPORT``.
* Each line is one ``os.write`` on an ``O_APPEND`` descriptor, so lines of several processes never interleave on a
  local file system. ``EINTR`` is retried; a short write continues with the rest of the line.
* Before each batch of lines the path is compared with the open descriptor (``stat`` vs ``fstat``): a file that
  was removed or replaced (log rotation, ``rm``, its directory removed) is reopened at the path, so lines do not
  vanish into an unlinked inode. A reopen does not recreate parent directories: a directory that disappeared
  (an unmounted volume, say) is an error to report, not something to recreate on another file system.
* ``EBADF`` (the descriptor was closed behind our back) reopens once and retries that line once.
* A line cut short by an error (``ENOSPC`` halfway) leaves a partial line in the file; the next line written
  starts with a newline, so every later line is whole and a reader only has to skip one unparsable line.
"""

from __future__ import annotations

import errno
import logging
import os

from kvcanary.settings import ENV_REPORT, check_report_path

logger = logging.getLogger(__name__)

_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC


class ReportFile:
    """One append-only report file. Not thread-safe: the ``Reporter`` serialises calls under its lock."""

    def __init__(self, path: str, *, var: str = ENV_REPORT) -> None:
        self.given_path = path
        self.path = os.path.abspath(path)  # reopen where it was opened, whatever the process's cwd becomes
        self.var = var
        self._fd: int | None = None
        self._torn = False  # the last write stopped inside a line
        self.reopens = 0

    # -- open / close --------------------------------------------------------------------------------------
    def open(self) -> None:
        """Start-up open: check the path, create parent directories, open. ``ValueError`` naming the variable."""
        check_report_path(self.given_path, self.var)
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._fd = os.open(self.path, _OPEN_FLAGS, 0o644)
        except OSError as exc:
            raise ValueError(
                f"{self.var}: cannot open {self.given_path!r} for appending: {exc.strerror or exc}"
            ) from exc

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        """Close (idempotent). Writes reach the OS as they happen; the fsync is best effort."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass  # a device or pipe cannot fsync; nothing is buffered here anyway
        try:
            os.close(fd)
        except OSError:
            pass  # already closed behind our back

    def _reopen(self, *, close_old: bool = True) -> int:
        """Open the path again (no parent directories created); raises the OSError when that fails.

        ``close_old=False`` after ``EBADF``: that number is no longer ours and may already name another file.
        """
        if close_old:
            self.close()
        self._fd = None
        self._fd = os.open(self.path, _OPEN_FLAGS, 0o644)
        self.reopens += 1
        return self._fd

    # -- writing -------------------------------------------------------------------------------------------
    def _current_fd(self) -> int:
        """The descriptor to write to: reopened when closed, or when the path no longer names the open file."""
        if self._fd is None:
            return self._reopen()
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            logger.info("kvcanary: report file %s was removed; reopening it", self.path)
            return self._reopen()
        except OSError:
            return self._fd  # cannot tell (e.g. permissions on a parent changed): keep writing where we were
        try:
            opened = os.fstat(self._fd)
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise
            return self._reopen(close_old=False)  # closed behind our back: reopen once
        if (on_disk.st_dev, on_disk.st_ino) != (opened.st_dev, opened.st_ino):
            logger.info("kvcanary: report file %s was replaced (rotated?); reopening it", self.path)
            return self._reopen()
        return self._fd

    def write_lines(self, lines: list[bytes]) -> tuple[int, OSError | None]:
        """Append ``lines`` (each ending in a newline), one ``os.write`` each, stopping at the first error that
        a retry did not cure. Returns (lines written, that error or None); never raises ``OSError``."""
        written = 0
        try:
            fd = self._current_fd()
            for line in lines:
                fd = self._write_one(fd, line)
                written += 1
        except OSError as exc:
            return written, exc
        return written, None

    def _write_one(self, fd: int, line: bytes) -> int:
        data = (b"\n" + line) if self._torn else line
        reopened = False
        started = False
        while data:
            try:
                n = os.write(fd, data)
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                if exc.errno == errno.EBADF and not reopened and not started:
                    fd = self._reopen(close_old=False)  # closed behind our back: reopen once, retry the line
                    reopened = True
                    continue
                if started:
                    self._torn = True
                raise
            started = True
            data = data[n:]
        self._torn = False
        return fd
