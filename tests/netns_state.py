"""What the netns tests share: whether this machine can build namespaces, and what a topology could leave behind."""

import re
import subprocess

import pytest

from aqpipe.launch import netns

CANNOT = netns.can_throttle()
needs_root = pytest.mark.skipif(CANNOT is not None, reason=f"cannot build namespaces here: {CANNOT}")


def left_of(names: set[str]) -> list[str]:
    """What is left of the topologies `names`: their namespaces and state files."""
    namespaces = [ns for ns in netns._namespaces() if any(ns.startswith(f"{netns.PREFIX}{n}-") for n in names)]
    return namespaces + [f"{n}.json" for n in sorted(names) if (netns.state_dir() / f"{n}.json").exists()]


def topologies_in(stderr: str) -> set[str]:
    """The topologies a launcher said it ran in ("aqpipe: every rank in its own network namespace (aqpipe-NAME-*)")."""
    return set(re.findall(rf"\({netns.PREFIX}([a-z0-9]+)-\*\)", stderr))


def assert_nothing_left(before: dict[str, str], names: set[str]) -> None:
    """Nothing of the topologies `names` is left, and the machine's own namespace has the links and qdiscs it had."""
    assert left_of(names) == []
    now = network_state()
    assert (now["links"], now["qdiscs"]) == (before["links"], before["qdiscs"])


def network_state() -> dict[str, str]:
    """What a topology could leak: namespaces, interfaces and qdiscs of the machine's own namespace, state files."""
    def run(*args: str) -> str:
        return subprocess.run(args, capture_output=True, text=True).stdout

    links = "\n".join(line.split("@")[0] for line in run("ip", "-o", "link", "show").splitlines())
    files = sorted(p.name for p in netns.state_dir().glob("*.json")) if netns.state_dir().is_dir() else []
    return {"namespaces": run("ip", "netns", "list"), "links": links, "qdiscs": run("tc", "qdisc", "show"),
            "state": " ".join(files)}
