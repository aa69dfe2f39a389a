"""Expected failures, and how every command-line tool reports them.

An expected failure is one the user can fix: a config, a data file, a checkpoint, a run directory,
the disk. Its class derives from `UserError`, and its message names the problem and the fix. The
CLIs (train.py, eval.longctx, eval.perplexity, eval.nsa_probe) hand their failures to
`report_error`, which prints such a failure as one line, ``error: <message>``, with exit status 1 (2 for a command line
or preset that cannot be read), and shows the traceback only with ``--debug``. A full disk (an
OSError such as ENOSPC anywhere in the exception's chain) is reported the same way. Anything else
is a bug: it keeps its traceback.

Exit statuses of the tools (README, "Runs"):
  0   finished
  1   refused input or a failure the message explains (data, checkpoint, non-finite loss, disk...)
  2   the command line or the config cannot be used (ConfigError)
  75  stopped before the end by SIGTERM / Ctrl-C, after saving a checkpoint: run the same command
      again to resume (EX_TEMPFAIL of sysexits.h: "try again later")
  130 interrupted without saving (a second Ctrl-C)

This module imports nothing heavy: every part of the package may derive its errors from it.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130

# OSErrors that mean the file system refused a write (not a bug in the caller).
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM}
_DISK_MESSAGES = ("no space left on device", "disk quota exceeded", "read-only file system",
                  "file too large")


class UserError(Exception):
    """A failure with a message that names the cause and the fix (see the module docstring)."""

    exit_status = EXIT_FAILED


class DataError(UserError, ValueError):
    """A data source that cannot be read as configured (missing, empty, binary or malformed)."""


class RunLockedError(UserError, RuntimeError):
    """Another live run holds the run directory."""


class DiskError(UserError, OSError):
    """The file system refused a write (full, over quota, read-only); see `disk_error`."""


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def disk_error(e: BaseException) -> OSError | str | None:
    """The OSError (or the message) in ``e``'s chain that says the file system refused a write:
    full, over quota, read-only, file too large or not permitted. None if there is none.
    (orbax and tensorstore may wrap the OSError in their own exceptions, with the reason only in
    the message.)"""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in _DISK_ERRNOS:
            return x
    for x in _chain(e):
        text = str(x)
        if any(m in text.lower() for m in _DISK_MESSAGES):
            return text.strip().splitlines()[0]
    return None


def describe(e: BaseException) -> tuple[str, int] | None:
    """(one-line report, exit status) of an expected failure, or None for a bug (which keeps its
    traceback). A UserError anywhere in ``e``'s chain counts (a data error raised inside the data
    pipeline's worker arrives wrapped)."""
    for x in _chain(e):
        if isinstance(x, UserError):
            return str(x), x.exit_status
    disk = disk_error(e)
    if disk is None:
        return None
    return disk_message(disk), EXIT_FAILED


def disk_message(disk: OSError | str) -> str:
    if isinstance(disk, OSError):
        where = f" ({disk.filename})" if disk.filename else ""
        disk = f"{disk.strerror or disk}{where}"
    else:  # tensorstore's form: ... Failed writing: "<path>": ... [os_error_code='28']
        code = re.search(r"os_error_code='?(\d+)", disk)
        path = re.search(r'Failed writing: "([^"]+)"', disk)
        if code:
            disk = os.strerror(int(code.group(1))) + (f" ({path.group(1)})" if path else "")
    return (f"the file system refused a write: {disk}. Free space (or fix the permissions) and "
            "run the same command again")


def quiet_library_tracebacks() -> None:
    """Without --debug: library loggers (orbax logs through absl) keep their one-line messages
    but not the tracebacks they attach, so a failure ends in our one ``error:`` line."""
    class _NoTraceback(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            return True

    logging.getLogger("absl").addFilter(_NoTraceback())


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (by default an expected "
                             "error is one line: error: ...)")


def report_error(e: BaseException, *, debug: bool,
                 expected: tuple[type[BaseException], ...] = ()) -> int | None:
    """A CLI's handler: prints an expected failure as ``error: ...`` on stderr (its traceback too
    with ``debug``) and returns its exit status; returns None for a bug, which the caller
    re-raises. ``expected``: more exception classes the tool treats as expected (the eval tools'
    ValueErrors from their own argument checks)."""
    if isinstance(e, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    report = describe(e)
    if report is None and isinstance(e, expected):
        report = str(e), EXIT_FAILED
    if report is None:
        return None
    if debug:
        traceback.print_exc()
    print(f"error: {report[0]}", file=sys.stderr)
    return report[1]
