"""The rank fork server: children with exactly their environment, session and name, exit statuses as subprocess
reports them, no thread or CUDA context copied into a rank, and nothing left once it is closed."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from aqpipe.launch import forkserver
from aqpipe.launch.forkserver import ForkServer, UnsafeFork
from aqpipe.launch.worker_entry import rank_imports


@pytest.fixture
def server():
    server = ForkServer(["torch"])
    yield server
    server.close()
    assert server.process.poll() is not None  # closed means gone, not going


def test_a_forked_child_has_exactly_its_environment_its_own_session_and_a_rank_name(server):
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.getcwd(), "SOMETHING": "given"}
    child = server.fork(2, env, target="tests.forkserver_targets:describe")
    seen = json.loads(child.stdout.read())
    assert child.wait(timeout=30) == 0 and child.returncode == 0
    assert seen["env"] == dict(env, AQPIPE_PARENT_PID=str(server.process.pid))  # nothing of the server's own
    # a process group of its own, in the server's session (away from the terminal's)
    assert seen["ppid"] == server.process.pid and seen["pid"] == child.pid == seen["pgid"]
    assert seen["sid"] == os.getsid(server.process.pid) != os.getsid(0)
    assert seen["comm"] == "aqpipe-rank-2"
    assert seen["torch"] and seen["threads"] == 1  # imported before the fork, and no thread came with it
    assert seen["netns"] == os.readlink("/proc/self/ns/net")


def test_exit_codes_read_as_subprocess_reports_them(server):
    env = {"PATH": os.environ["PATH"]}
    leaving = server.fork(0, env, target="tests.forkserver_targets:exit_3")
    assert leaving.wait(timeout=30) == 3
    assert "leaving with 3" in leaving.stdout.read()  # stderr goes to the same pipe
    sleeper = server.fork(1, env, target="tests.forkserver_targets:sleep")
    assert sleeper.stdout.readline().strip() == "ready" and sleeper.poll() is None
    os.killpg(sleeper.pid, signal.SIGKILL)  # its own process group, as the launcher stops ranks
    assert sleeper.wait(timeout=30) == -signal.SIGKILL
    still = server.fork(2, env, target="tests.forkserver_targets:sleep")
    assert still.stdout.readline().strip() == "ready"  # (running its target: on busy cores that takes a while)
    with pytest.raises(subprocess.TimeoutExpired):
        still.wait(timeout=0.2)
    server.close()  # a child that never ends dies with its server, whatever it runs
    # End of file: the child, which held the pipe's write end, has been killed (its pid may still be in /proc a
    # moment longer while the kernel finishes it, so that is not asked).
    assert still.stdout.read() == ""


def test_a_server_that_started_a_thread_does_not_fork_and_ranks_start_afresh(capfd):
    server = ForkServer(["tests.forkserver_threads"])
    try:
        with pytest.raises(UnsafeFork, match="started 1 thread"):
            server.fork(0, {"PATH": os.environ["PATH"]})
        env = dict(os.environ, RANK="0", WORLD_SIZE="1")  # no configuration: the worker fails at once, as it should
        proc = server.start(0, env)
        assert isinstance(proc, subprocess.Popen) and proc.args == forkserver.WORKER_COMMAND
        proc.wait(timeout=120)
        assert "ranks start as fresh processes, not forked (an import started 1 thread(s)" in capfd.readouterr().err
    finally:
        server.close()


# A script as the Python API runs it: serving its ranks where started as their server, else a rank run afresh.
SCRIPT = [sys.executable, "-c", f"""
import os, threading, time
{{thread}}
if {forkserver.SCRIPT_SERVER_ENV!r} in os.environ:
    from aqpipe.launch.rank_server import serve_script
    serve_script(None)
print("a rank running the script afresh, for call", os.environ.get("AQPIPE_TRAIN_CALL"))
"""]


@pytest.mark.parametrize(("thread", "why"), [
    ("threading.Thread(target=time.sleep, args=(60,), daemon=True).start()", "an import started 1 thread(s)"),
    (f"if {forkserver.SCRIPT_SERVER_ENV!r} in os.environ: raise SystemExit(0)",
     "the run of the script that was to fork them ended before it reached aqpipe.train")])
def test_a_scripts_ranks_run_it_afresh_where_its_server_holds_a_thread_or_ended(capfd, thread, why):
    command = [SCRIPT[0], SCRIPT[1], SCRIPT[2].format(thread=thread)]
    server = ForkServer.for_script(command)
    try:
        proc = server.start(0, dict(os.environ, RANK="0", WORLD_SIZE="1"))
        assert isinstance(proc, subprocess.Popen) and proc.args == command
        assert proc.wait(timeout=120) == 0 and "a rank running the script afresh, for call 1" in proc.stdout.read()
        assert f"ranks start as fresh processes, not forked ({why}" in capfd.readouterr().err
        assert server.process.poll() is not None  # the server is no use now: gone at once, and what it held with it
    finally:
        server.close()


def _gone(pid: int, within: float = 10.0) -> bool:
    """Whether process `pid` has ended (a zombie nobody reaped counts as ended) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


# A script whose run as the server is stuck before aqpipe.train, having started a process of its own.
STUCK_SCRIPT = """
import os, subprocess, sys, time
import aqpipe
child = subprocess.Popen(["sleep", "600"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""

STUCK_LAUNCHER = """
import os, signal, sys, threading, time
from aqpipe.launch.forkserver import ForkServer
from aqpipe.launch.signals import interrupts_raise
script, pids, then = sys.argv[1:]
interrupts_raise()
server = ForkServer.for_script([sys.executable, script, pids])
while not os.path.exists(pids):
    if server.process.poll() is not None:
        sys.exit("the script ended before it wrote its pids")
    time.sleep(0.05)
print("waiting", flush=True)
if then == "interrupt":
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
try:
    server.start(0, dict(os.environ, RANK="0", WORLD_SIZE="1"))
except KeyboardInterrupt:
    print("interrupted", flush=True)
finally:
    server.close()
"""


def _stuck_launch(tmp_path, then: str) -> tuple[subprocess.Popen, list[int]]:
    (tmp_path / "script.py").write_text(STUCK_SCRIPT)
    pids = tmp_path / "pids"
    launcher = subprocess.Popen([sys.executable, "-c", STUCK_LAUNCHER, str(tmp_path / "script.py"), str(pids), then],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if launcher.stdout.readline().strip() != "waiting":
        pytest.fail(launcher.communicate(timeout=30)[1][-3000:])
    return launcher, [int(pid) for pid in pids.read_text().split()]


def test_a_ctrl_c_while_a_scripts_server_has_not_reached_train_stops_the_launch_and_leaves_nothing(tmp_path):
    """The script's run that is to fork the ranks may take long (or forever) before it calls aqpipe.train: a Ctrl-C
    in the launcher meanwhile interrupts the wait for it, and closing the server ends it and what it started."""
    launcher, (server, its_child) = _stuck_launch(tmp_path, "interrupt")
    try:
        out, _ = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
    assert out.strip() == "interrupted" and launcher.returncode == 0
    assert _gone(server) and _gone(its_child)


def test_a_scripts_server_that_has_not_reached_train_dies_with_a_killed_launcher(tmp_path):
    launcher, (server, _) = _stuck_launch(tmp_path, "wait")
    launcher.kill()
    launcher.wait()
    assert _gone(server)


def test_a_scripts_server_that_fails_while_serving_says_why_and_exits_1():
    probe = "from aqpipe.launch.rank_server import serve_script\nserve_script(None)\n"
    env = dict(os.environ, **{forkserver.SCRIPT_SERVER_ENV: json.dumps({"socket": 999, "run": None}),
                              forkserver.PARENT_ENV: str(os.getpid())})
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1 and "Bad file descriptor" in out.stderr, out.stderr[-3000:]


def test_a_plain_run_imports_none_of_what_only_some_runs_need(tmp_path):
    """matplotlib (the loss plot, drawn at the end), peft (LoRA), datasets (hub data) and gguf (a GGUF model) each
    take seconds to import: the launcher's plan and the ranks' preload of a gpt2-tiny run on the built-in corpus
    load none of them."""
    modules = rank_imports(model="gpt2-tiny")
    probe = ("import sys\n"
             "from aqpipe.launch.rank_server import import_for_ranks\n"
             "from aqpipe.config import RunConfig, resolve\n"
             "from aqpipe.runtime.plan import make_plan\n"
             f"import_for_ranks({modules!r})\n"
             f"make_plan(resolve(RunConfig(model='gpt2-tiny', device='cpu', out={str(tmp_path / 'run')!r})))\n"
             "print(sorted(m for m in ('matplotlib', 'peft', 'datasets', 'gguf') if sys.modules.get(m) is not None))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-3000:])


def test_a_forked_rank_of_a_model_without_transformers_makes_its_optimizer_importing_nothing_and_collects_no_module():
    """After the server's imports a rank forked from it imports nothing of its own when it makes its optimizer
    (torch.optim imports torch._dynamo then, about half a second per rank, unless the server did), and a full
    collection in it walks none of the server's imports (they are frozen: walking them costs a quarter of a second and
    copies every page the fork shares). The probe imports as the server does and looks in its own process."""
    modules = rank_imports(model="examples.custom_model:tiny_lm")
    probe = ("import gc, sys, torch\n"
             "from aqpipe.launch.rank_server import import_for_ranks\n"
             f"import_for_ranks({modules!r})\n"
             "before = set(sys.modules)\n"
             "torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])\n"
             "print(sorted(set(sys.modules) - before))\n"
             "print(gc.get_freeze_count() > 100_000, len(gc.get_objects()) < gc.get_freeze_count() // 10)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0 and out.stdout.splitlines() == ["[]", "True True"], (out.stdout, out.stderr[-3000:])


@pytest.mark.needs("peft")
def test_what_the_server_imports_starts_no_thread_and_no_cuda():
    """Every module a rank of these runs needs, imported the way the server does (OPENBLAS_NUM_THREADS=1):
    afterwards one thread, and torch.cuda never asked to initialise (a CUDA context does not survive a fork)."""
    runs = [dict(model="gpt2-tiny"), dict(model="llama-tiny", lora=True, store="lmdb"), dict(model="bert-tiny"),
            dict(model="smollm2-135m"), dict(model="qwen2-tiny")]
    modules = sorted({m for settings in runs for m in rank_imports(**settings)})
    assert {"peft", "aqpipe.storage.lmdb_store", "transformers.models.gpt2.modeling_gpt2",
            "transformers.models.bert.modeling_bert", "transformers.models.qwen2.modeling_qwen2"} <= set(modules)
    probe = ("import sys, torch, torch.cuda\n"
             "calls = []\n"
             "torch.cuda._lazy_init = lambda *a, **k: calls.append('lazy_init')\n"
             "from aqpipe.launch.fork_safety import cuda_initialised, native_threads\n"
             "from aqpipe.launch.rank_server import import_for_ranks\n"
             f"import_for_ranks({modules!r})\n"
             f"missing = [m for m in {modules!r} if m not in sys.modules]\n"
             "print(native_threads(), calls, cuda_initialised(), missing)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert out.stdout.strip() == "1 [] False []", out.stderr[-3000:]


def test_closing_a_server_that_started_no_rank_does_not_wait_for_its_imports():
    """A launch refused after the server started (a bad setting found while planning) ends at once: the server is
    stopped mid-import, not awaited."""
    server = ForkServer(["torch", "transformers.models.llama.modeling_llama"])
    server.close()
    assert server.process.returncode == -signal.SIGKILL


@pytest.mark.needs("peft")
def test_a_server_for_a_run_forks_ranks_that_have_its_model_code_already():
    server = ForkServer.for_run("llama-tiny", lora=8, store="lmdb")
    try:
        child = server.fork(0, {"PATH": os.environ["PATH"], "PYTHONPATH": os.getcwd()},
                            target="tests.forkserver_targets:describe")
        seen = json.loads(child.stdout.read())
        assert child.wait(timeout=60) == 0
        assert {"transformers.models.llama.modeling_llama", "peft", "aqpipe.storage.lmdb_store",
                "aqpipe.runtime.rank.train"} <= set(seen["modules"]) and seen["threads"] == 1
    finally:
        server.close()
        server.close()  # a second close does nothing (the launcher and the command line both close it)
    assert server.process.returncode == 0


FORKED_HERE = """
import io, json, os, sys
from aqpipe.launch.forkserver import ForkServer, ForkedChild
server = ForkServer.forked_here("gpt2-tiny")
given, sys.stdout = sys.stdout, io.StringIO()  # a caller capturing output: the rank still writes to its pipe
child = server.fork(1, dict(os.environ), target="tests.forkserver_targets:describe")
sys.stdout = given
seen = json.loads(child.stdout.read())
child.wait(timeout=60)
server.close()
print(json.dumps({"forked": isinstance(server.process, ForkedChild), "server": server.process.pid,
                  "server_code": server.process.returncode, "launcher": os.getpid(),
                  "here": "transformers.models.gpt2.modeling_gpt2" in sys.modules,
                  "blas_here": os.environ.get("OPENBLAS_NUM_THREADS"), **seen}))
"""


def test_a_launcher_imports_once_and_forks_its_server_from_itself():
    """`aqpipe launch` imports what its ranks need in its own process (planning needs the same modules) and forks
    the server from it: the rank's parent is a child of the launcher, the model code was imported before, and the
    environment the rank gets is the user's (the launcher's import-time settings are not left in it)."""
    out = subprocess.run([sys.executable, "-c", FORKED_HERE], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["forked"] and seen["here"] and seen["ppid"] == seen["server"] and seen["server_code"] == 0
    assert "transformers.models.gpt2.modeling_gpt2" in seen["modules"] and seen["threads"] == 1
    assert seen["blas_here"] is None and "OPENBLAS_NUM_THREADS" not in seen["env"]


def test_a_launcher_holding_a_thread_starts_its_server_afresh_instead():
    probe = ("import threading, time\n"
             "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
             "from aqpipe.launch.forkserver import ForkServer\n"
             "import subprocess\n"
             "server = ForkServer.forked_here('gpt2-tiny')\n"
             "print(isinstance(server.process, subprocess.Popen))\n"
             "server.close()\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True", out.stderr[-3000:]


JEMALLOC = next((path for path in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2",
                                   "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2") if os.path.exists(path)), None)


@pytest.mark.skipif(JEMALLOC is None, reason="libjemalloc.so.2 is not installed (apt install libjemalloc2)")
def test_a_launch_under_jemalloc_with_background_threads_forks_its_ranks(tmp_path):
    """An image's allocator, for real: jemalloc preloaded with background threads on. The ranks are forked
    from the server (not started afresh) and train."""
    env = {**os.environ, "LD_PRELOAD": JEMALLOC, "MALLOC_CONF": "background_thread:true"}
    out = subprocess.run([sys.executable, "-m", "aqpipe", "launch", "--model", "gpt2-tiny", "--pp", "2", "--steps",
                          "2", "--seq-len", "16", "--max-samples", "16", "--micro-batches", "2", "--no-progress",
                          "--eval-every", "0", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fresh processes" not in out.stderr, out.stderr
