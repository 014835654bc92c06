"""What test_forkserver's forked children run (importable by name from the fork server)."""

import json
import os
import sys
import time

from aqpipe.launch.fork_safety import native_threads


def describe() -> int:
    """Print what the child is: its ids, name, session, environment, threads, network namespace, preloaded modules."""
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "pgid": os.getpgid(0),
                      "comm": open("/proc/self/comm").read().strip(), "env": dict(os.environ),
                      "threads": native_threads(), "netns": os.readlink("/proc/self/ns/net"),
                      "torch": "torch" in sys.modules, "modules": sorted(sys.modules)}))
    return 0


def exit_3() -> int:
    print("leaving with 3", file=sys.stderr)
    return 3


def sleep() -> int:
    print("ready", flush=True)
    time.sleep(600)
    return 0
