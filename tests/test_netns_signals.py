"""Throttled topologies under signals and killed ranks: Ctrl-C or SIGTERM at any moment of a topology's building or
handing over, a killed rank or an interrupted launcher, and nothing is left behind."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aqpipe.launch import netns
from tests.netns_state import assert_nothing_left, needs_root, network_state, topologies_in
from tests.processes import finish, none_left, start_run, tagged_processes

# with the other netns tests (tests/test_netns.py says why one worker)
pytestmark = pytest.mark.xdist_group("netns")


@contextlib.contextmanager
def raising_interrupts():
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block, as in the launcher; the test's handlers after it."""
    from aqpipe.launch.signals import interrupts_raise

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        interrupts_raise()
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@needs_root
def test_killed_worker_under_bandwidth_leaves_no_namespace_link_or_qdisc(tmp_path):
    before = network_state()
    proc, tag = start_run(tmp_path, "--bandwidth", "200mbit")
    assert network_state()["namespaces"] != before["namespaces"]  # it really runs in namespaces
    os.kill(tagged_processes(tag, rank="1")[0], signal.SIGKILL)
    code, err, _ = finish(proc, timeout=60)
    assert code == 1 and "rank 1 (stage 1, replica 0) died: killed by signal SIGKILL" in err
    assert tagged_processes(tag) == []
    assert len(topologies_in(err)) == 1
    assert_nothing_left(before, topologies_in(err))


@needs_root
def test_interrupted_launcher_under_bandwidth_cleans_up(tmp_path):
    before = network_state()
    proc, tag = start_run(tmp_path, "--bandwidth", "200mbit")
    proc.send_signal(signal.SIGINT)
    code, err, _ = finish(proc, timeout=60)
    assert code == 1 and "interrupted" in err
    assert tagged_processes(tag) == []
    assert len(topologies_in(err)) == 1
    assert_nothing_left(before, topologies_in(err))


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_during_namespace_setup_leaves_nothing(tmp_path, sig):
    """Ctrl-C or SIGTERM while the namespaces are being built (the state file is written first, so its appearance
    means the build has begun): exit 1 with one line, and no namespace, link, qdisc, state file or rank left."""
    import time
    import uuid

    before = network_state()
    state = tmp_path / "state"
    tag = uuid.uuid4().hex
    env = dict(os.environ, AQPIPE_TEST_TAG=tag, AQPIPE_NETNS_STATE=str(state))
    proc = subprocess.Popen([sys.executable, "-m", "aqpipe", "launch", "--bandwidth", "100mbit", "--pp", "4",
                             "--seq-len", "16", "--max-samples", "64", "--steps", "50", "--no-progress",
                             "--out", str(tmp_path / "run")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (state.is_dir() and any(state.glob("*.json"))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    names = {p.stem for p in state.glob("*.json")}
    proc.send_signal(sig)
    code, err, _ = finish(proc, timeout=60)
    assert code == 1 and "interrupted" in err and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("aqpipe: run failed: interrupted"), err
    assert none_left(tag)
    assert not list(state.glob("*.json"))
    assert_nothing_left(before, names)


@pytest.mark.parametrize("at", [1, 22], ids=["first-command", "last-command"])
def test_a_signal_during_setup_never_cuts_an_ip_command_short_and_the_build_stops_after_it(tmp_path, monkeypatch, at):
    """An interrupt that arrives while an `ip` command runs is taken once that command is done, before the next one
    (or, after the last, before the topology is handed out), and then everything built is removed. Raised inside the
    command instead, it could leave its `ip` process running unattended (an interrupt while the child starts escapes
    `subprocess.run` without killing it), which went on to make a namespace after the cleanup had listed them: seen
    as a leftover bridge namespace in CI."""
    monkeypatch.setenv("AQPIPE_NETNS_STATE", str(tmp_path))
    monkeypatch.setattr(netns, "can_throttle", lambda: None)
    monkeypatch.setattr(netns, "_namespaces", lambda: [])
    ran, finished = [], []

    def run(*args):
        ran.append(args)
        if len(ran) == at:
            os.kill(os.getpid(), signal.SIGTERM)  # (a handler that raises runs at once, inside this command)
        finished.append(args)
        return ""

    monkeypatch.setattr(netns, "_run", run)
    with raising_interrupts(), pytest.raises(KeyboardInterrupt):
        netns.create(2, 10**8, name="sig")
    assert ran == finished and len(ran) == at  # (2 ranks, one bridge: 22 commands in all)
    assert ran[0] == ("ip", "netns", "add", f"{netns.PREFIX}sig-br")
    assert not list(tmp_path.glob("*.json"))


def test_a_signal_as_the_state_file_is_written_leaves_no_state_file(tmp_path, monkeypatch):
    """The state file is written first, so a build cut short can be cleaned up; an interrupt that came while it was
    being written (before the cleanup's `try`) left it behind with nothing built: seen in CI, where the test above
    it signals the launcher as soon as the file appears."""
    monkeypatch.setenv("AQPIPE_NETNS_STATE", str(tmp_path))
    monkeypatch.setattr(netns, "can_throttle", lambda: None)
    monkeypatch.setattr(netns, "_namespaces", lambda: [])
    ran: list[tuple[str, ...]] = []
    monkeypatch.setattr(netns, "_run", lambda *args: ran.append(args) or "")
    write_text = Path.write_text

    def write_then_signal(path, *args, **kwargs):
        written = write_text(path, *args, **kwargs)
        if path.suffix == ".json" and path.parent == tmp_path:
            os.kill(os.getpid(), signal.SIGTERM)  # (a handler that raises runs at once, here)
        return written

    monkeypatch.setattr(Path, "write_text", write_then_signal)
    with raising_interrupts(), pytest.raises(KeyboardInterrupt):
        netns.create(2, 10**8, name="sigfile")
    assert ran == []  # nothing built
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("when", ["handed over", "before anything is built", "a name clash"])
def test_the_launcher_removes_its_topology_whenever_a_signal_comes_and_only_its_own(tmp_path, monkeypatch, when):
    """A signal between `netns.create` returning (its own clean-up over) and the launcher's clean-up taking charge
    left the built topology behind until some later launch found it stale. A signal before anything is built (create
    waiting for another launch's lock) stops the launch at once with nothing to remove; a name clash is another
    launch's topology, a configuration error, and not removed."""
    from aqpipe.config import ConfigError, build_config, resolve
    from aqpipe.launch import job

    registered, removed = set(), []

    def create(ranks, rate_bits, name, **kwargs):
        if when == "a name clash":
            registered.add(name)  # (the other launch's)
            raise netns.NetnsError(f"a topology named {name!r} exists already")
        if when == "before anything is built":
            os.kill(os.getpid(), signal.SIGTERM)  # (a handler that raises runs at once, here)
        registered.add(name)
        os.kill(os.getpid(), signal.SIGTERM)
        return netns.Topology(name, ranks, rate_bits, os.getpid())

    monkeypatch.setattr(netns, "create", create)
    monkeypatch.setattr(netns, "registered", lambda name: name in registered)
    monkeypatch.setattr(netns, "destroy", lambda name: removed.append(name) or [])
    cfg = resolve(build_config({}, {"bandwidth": "100mbit", "pp": 2, "out": str(tmp_path / "run")}))
    expected = ConfigError if when == "a name clash" else KeyboardInterrupt
    with raising_interrupts(), pytest.raises(expected), job._topology(cfg):
        pytest.fail("the run must not start")
    assert removed == (list(registered) if when == "handed over" else [])
