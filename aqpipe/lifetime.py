"""How aqpipe's processes end: a helper's life tied to its parent's (the ranks a launcher starts, the fork server's
children and a rank's checkpoint copier end when the process that started them does, even when it was killed), and
a command's or a rank's exit without the tear-down of what it imported."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
from typing import NoReturn

PARENT_ENV = "AQPIPE_PARENT_PID"  # in a helper's environment: the pid of the process it must die with
SCRIPT_SERVER_ENV = "AQPIPE_SCRIPT_SERVER"  # in a script's run that is to fork the ranks: its socket and what to import
script_server: dict | None = None  # in that run, once it imported aqpipe: what SCRIPT_SERVER_ENV said


def die_with(parent: int) -> None:
    """Be killed (SIGKILL) when process `parent`, which started this one, dies; exit at once if it already has."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def die_with_parent() -> None:
    """die_with the process PARENT_ENV names, where the environment names one."""
    parent = os.environ.get(PARENT_ENV)
    if parent is not None:
        die_with(int(parent))


def take_script_server() -> None:
    """In the run of a script that `aqpipe.train` started to fork its ranks from (launch/forkserver.py), at the
    script's `import aqpipe`: die with the launcher from then on, however long the script takes to reach the call,
    and take the server's settings out of the environment, which processes the script starts would inherit."""
    global script_server
    if SCRIPT_SERVER_ENV not in os.environ:
        return
    import json

    given = json.loads(os.environ.pop(SCRIPT_SERVER_ENV))
    parent = int(os.environ.pop(PARENT_ENV))
    die_with(parent)
    script_server = dict(given, parent=parent)


def leave(code: int) -> NoReturn:
    """End this process with exit code `code` the way `sys.exit` would, less the tear-down of every imported module:
    torch's and transformers' take a process that imported them 1-2.5 s of CPU on a 2-core machine, for nothing.
    Exit handlers run first. While another (non-daemon) thread still works, the process ends the ordinary way,
    after it."""
    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe (`aqpipe … | head`): nothing more can reach it
                pass
        os._exit(code)
