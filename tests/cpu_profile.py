"""A pytest plugin that records what each test costs the machine: its wall time and the CPU time every process on
the machine spent meanwhile (from /proc/stat, so ranks, launchers and the kernel's packet work all count). Run it
serially, alone on the machine, so that the CPU of a test is its own:

    AQPIPE_TEST_CPU_LOG=cpu.jsonl python -m pytest -p tests.cpu_profile -n 0 tests/test_hosts.py

Each test appends one JSON line: node id, wall seconds, CPU seconds (all cores), and of those the kernel's
(system, irq, softirq). Without AQPIPE_TEST_CPU_LOG the plugin does nothing.
"""

from __future__ import annotations

import json
import os
import time

import pytest

LOG = "AQPIPE_TEST_CPU_LOG"


def _cpu() -> tuple[float, float]:
    """All cores' busy time and, of it, the kernel's (seconds)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, (system + irq + softirq) / tick


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around one test's setup, call and teardown."""
    path = os.environ.get(LOG)
    if not path:
        yield
        return
    wall, (busy, kernel) = time.monotonic(), _cpu()
    yield
    busy_after, kernel_after = _cpu()
    record = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall, 2), "cpu_s": round(busy_after - busy, 2),
              "kernel_s": round(kernel_after - kernel, 2)}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
