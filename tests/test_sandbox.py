"""The local code sandbox against an adversarial corpus of model programs (reliability.md 1.3 and 5.1).

Every program runs once under the layers `probe_sandbox()` picks (namespaces here) and, where root and seccomp are
available, once more without namespaces (the fallback for Docker). All runs go through a thread pool in one
module-scoped fixture, then each test checks one run: its status, that it returned in time, and that it did no harm:
no process left (found by a per-run marker in /proc/*/cmdline), nothing written outside its temp dir, no connection
to a listener the test owns, no secret in its output, the test process alive and not bloated.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import socket
import stat
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

from grpo.rewards.sandbox import (
    SANDBOX_UIDS,
    SandboxLayers,
    SandboxResult,
    SandboxUnavailable,
    _classify,
    probe_sandbox,
    run_sandboxed,
)
from grpo.rewards.sandbox_init import _mount_points

LAYERS = probe_sandbox()
pytestmark = pytest.mark.skipif(not LAYERS.isolated, reason=f"no sandbox layers here: {LAYERS.describe()}")

TIMEOUT_S = 2.0
SECRET = "sk-fake-" + uuid.uuid4().hex
ANY_FAILURE = {"error", "timeout", "oom", "crashed", "output_limit"}
FALLBACK = SandboxLayers(userns=False, uid_drop=True, seccomp=True, interpreter=LAYERS.interpreter)
FALLBACK_WORKS = os.geteuid() == 0 and LAYERS.seccomp


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    program: str  # placeholders: @TARGET@ (path under the test's tmp dir), @MARK@, @PORT@, @WWDIR@, @SECRET_FILE@
    statuses: set
    stdin: str = ""
    stdout: str | None = None  # exact stdout expected, when the program is well behaved
    ns_only: bool = False  # the fallback (no mount namespace) leaves world-writable host dirs writable by design


TOUCH = "open('@TARGET@', 'w').write('escaped')"
CASES = [
    Case("correct", "a, b = map(int, input().split())\nprint(a + b)", {"ok"}, "2 3\n", "5\n"),
    Case("wrong", "a, b = map(int, input().split())\nprint(a - b)", {"ok"}, "2 3\n", "-1\n"),
    Case("infinite_loop", "while True:\n    pass", {"timeout"}),
    Case("sleep_forever", "import time\ntime.sleep(10**6)", {"timeout"}),
    Case("ignore_term_and_alarm", """
        import signal
        for s in (signal.SIGTERM, signal.SIGALRM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        while True:
            pass""", {"timeout"}),
    Case("memory_bomb_3gib", "b = bytearray(3 << 30)\nb[::4096] = b'x' * len(b[::4096])", {"oom"}),
    Case("slow_memory_growth", "xs = []\nwhile True:\n    xs.append(' ' * 10**6)", {"oom", "timeout"}),  # 2 busy cores
    # Unbounded only when the probe confirmed the uid drop (RLIMIT_NPROC binds); else 150 forks (reliability.md 5.9).
    Case("fork_bomb", """
        import os, time
        n = 0
        while @UNBOUNDED@ or n < 150:
            n += 1
            try:
                os.fork()
            except OSError:  # at the process limit: keep every slot taken, without starving the other runs' CPU
                time.sleep(0.05)""", {"timeout", "error", "crashed"}),
    Case("forks_setsid_sleep", """
        import os, time
        for _ in range(20):
            if os.fork() == 0:
                os.setsid()
                time.sleep(60)
                os._exit(0)
        print('parent done')""", {"ok"}, stdout="parent done\n"),
    Case("threads_2000", """
        import threading, time
        for _ in range(2000):
            threading.Thread(target=time.sleep, args=(60,), daemon=True).start()""", {"error"}),
    Case("os_system", "import os\nos.system(\"touch '@TARGET@'\")", {"ok", "error"}),
    Case("posix_system", "import posix\nposix.system(\"touch '@TARGET@'\")", {"ok", "error"}),
    Case("ctypes_system", "import ctypes\nctypes.CDLL(None).system(b\"touch '@TARGET@'\")", {"ok", "error"}),
    Case("reload_os", "import importlib, os\nos.system = None\nos = importlib.reload(os)\nos.system(\"touch '@TARGET@'\")",
         {"ok", "error"}),
    Case("posix_spawn", "import os\nos.waitpid(os.posix_spawn('/usr/bin/touch', ['touch', '@TARGET@'], {}), 0)",
         {"ok", "error"}),
    Case("execv", "import os\nos.execv('/usr/bin/touch', ['touch', '@TARGET@'])", {"ok", "error"}),
    Case("popen_grandchild_holds_pipes", """
        import subprocess, sys
        subprocess.Popen(['sh', '-c', 'sleep 100 & echo started'])
        subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(100)', '@MARK@'])
        print('done')""", {"ok"}),
    Case("open_outside_for_write", TOUCH, {"error"}),
    Case("write_tmp", "open('/tmp/@MARK@', 'w').write('x')", {"ok"}, ns_only=True),
    Case("write_var_tmp_and_dev_shm", """
        for path in ('/var/tmp/@MARK@', '/dev/shm/@MARK@'):
            try:
                open(path, 'w').write('x')
            except OSError as e:
                print(path[:8], type(e).__name__)""", {"ok"}, ns_only=True),
    Case("write_world_writable_dir", "open('@WWDIR@/@MARK@', 'w').write('x')", {"error"}, ns_only=True),
    Case("umount_tmp_then_write", """
        import ctypes
        print(ctypes.CDLL(None).umount2(b'/tmp', 2))
        open('/tmp/@MARK@', 'w').write('x')""", {"ok"}, stdout="-1\n", ns_only=True),
    Case("new_namespace", """
        import ctypes
        libc = ctypes.CDLL(None)
        print(libc.unshare(0x10000000), libc.mount(b'none', b'/mnt', b'tmpfs', 0, None))""", {"ok"},
         stdout="-1 -1\n"),
    Case("read_root_only_file", "print(open('@SECRET_FILE@').read())", {"error"}),
    Case("read_env_secret", """
        import os
        print(dict(os.environ))
        print(open('/proc/self/environ').read())
        print(open('/proc/1/environ').read())""", {"ok", "error"}),
    Case("connect_loopback", """
        import socket
        socket.create_connection(('127.0.0.1', @PORT@), timeout=1).sendall(b'hello')""", {"error"}),
    Case("udp_loopback", """
        import socket
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'hello', ('127.0.0.1', @PORT@))""", {"error"}),
    Case("kill_parent_and_all", """
        import os
        for target in (os.getppid(), -1):
            try:
                os.kill(target, 9)
            except OSError as e:
                print(type(e).__name__)
        print('survived')""", {"ok"}),
    Case("stdout_flood", "import sys\nchunk = 'x' * 65536\nfor _ in range(8000):\n    sys.stdout.write(chunk)",
         {"output_limit"}),
    Case("stderr_flood", "import sys\nchunk = 'x' * 65536\nfor _ in range(8000):\n    sys.stderr.write(chunk)",
         {"output_limit"}),
    Case("disk_fill", "f = open('big', 'wb')\nfor _ in range(1024):\n    f.write(b'x' * (1 << 20))", {"error"}),
    Case("open_10000_files", "fs = [open(f'f{i}', 'w') for i in range(10000)]", {"error"}),
    Case("segfault", "import ctypes\nctypes.string_at(0)", {"crashed"}),
    Case("huge_power", "print(9**9**9**9)", {"timeout", "oom"}),
    Case("deep_recursion", "import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)",
         {"crashed", "error", "oom", "timeout"}),  # 3.11 keeps Python frames off the C stack
    Case("exit_zero_early", "import os\nos._exit(0)\nprint('unreached')", {"ok"}, stdout=""),
    Case("exit_builtin", "print('before')\nexit(3)", {"error"}, stdout="before\n"),
    Case("binary_output", "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\x00ok')", {"ok"}),
]


@dataclasses.dataclass
class Outcome:
    result: SandboxResult
    leaked: list
    written: list
    connections: int


def _processes_with(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                seen = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
            except OSError:
                continue
            if marker.encode() in seen:
                pids.append(int(proc.name))
    return pids


def _sandbox_uid_processes() -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            uid_line = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(uid_line.split()[1]) in SANDBOX_UIDS:
            found.append(f"{proc.name}: {(proc / 'cmdline').read_bytes()!r}")
    return found


def _vm_hwm_kb() -> int:
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmHWM:")).split()[1])


def _run_case(case: Case, layers: SandboxLayers, mode: str, root: Path, wwdir: Path, secret_file: Path) -> Outcome:
    """Run one program with its own marker, target path and listener, then look for harm right away."""
    mark = f"grpo-sbx-test-{uuid.uuid4().hex[:10]}-{case.name}-{mode}"
    target = root / mark
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        program = textwrap.dedent(case.program).strip()
        for key, value in {"@TARGET@": target, "@MARK@": mark, "@PORT@": port, "@WWDIR@": wwdir,
                           "@SECRET_FILE@": secret_file, "@UNBOUNDED@": layers.uid_drop}.items():
            program = program.replace(key, str(value))
        result = run_sandboxed(f"# {mark}\n{program}", case.stdin, timeout_s=TIMEOUT_S, layers=layers)
        leaked = _processes_with(mark)
        connections = 0
        while True:
            try:
                listener.accept()[0].close()
            except BlockingIOError:
                break
            connections += 1
    candidates = [target, Path("/tmp") / mark, Path("/var/tmp") / mark, Path("/dev/shm") / mark, wwdir / mark]
    return Outcome(result, leaked, [str(p) for p in candidates if p.exists()], connections)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """{(mode, case name): Outcome} for every case and mode, run 4 at a time, plus the caller's memory growth."""
    root = tmp_path_factory.mktemp("sandbox-targets")
    wwdir = Path(tempfile.mkdtemp(prefix="grpo-sbx-ww-", dir="/var/tmp"))
    os.chmod(wwdir, 0o1777)  # writable by any uid, so only the sandbox stops a write
    secret_file = wwdir / "root-only-secret"
    secret_file.write_text(SECRET)
    os.chmod(secret_file, stat.S_IRUSR | stat.S_IWUSR)
    os.environ["GRPO_TEST_FAKE_API_KEY"] = SECRET
    runs = [(case, LAYERS, "probed") for case in CASES]
    if FALLBACK_WORKS:
        runs += [(case, FALLBACK, "fallback") for case in CASES if not case.ns_only]
    hwm_before = _vm_hwm_kb()
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            futures = {(mode, case.name): pool.submit(_run_case, case, layers, mode, root, wwdir, secret_file)
                       for case, layers, mode in runs}
            outcomes = {key: future.result() for key, future in futures.items()}
    finally:
        del os.environ["GRPO_TEST_FAKE_API_KEY"]
    outcomes["hwm_growth_kb"] = _vm_hwm_kb() - hwm_before
    yield outcomes
    for path in wwdir.iterdir():
        path.unlink()
    wwdir.rmdir()


def _modes(case: Case) -> list:
    modes = [pytest.param("probed", case, id=f"probed-{case.name}")]
    if not case.ns_only:
        marks = pytest.mark.skipif(not FALLBACK_WORKS, reason="fallback needs root and libseccomp")
        modes.append(pytest.param("fallback", case, id=f"fallback-{case.name}", marks=marks))
    return modes


@pytest.mark.parametrize(("mode", "case"), [p for case in CASES for p in _modes(case)])
def test_adversarial_program_is_contained(corpus, mode, case):
    outcome = corpus[(mode, case.name)]
    result = outcome.result
    assert result.status in case.statuses, (result.status, result.detail, result.stderr[-500:])
    assert result.wall_s < TIMEOUT_S + 1.5 < 15  # the deadline holds, plus process start and teardown
    assert outcome.leaked == [], "processes of the run survived it"
    assert outcome.written == [], "the program wrote outside its temp dir"
    assert outcome.connections == 0
    assert SECRET not in result.stdout + result.stderr
    assert len(result.stdout) <= 65536 and len(result.stderr) <= 65536
    if case.stdout is not None:
        assert result.stdout == case.stdout


def test_corpus_leaves_no_process_no_temp_dir_and_no_bloat(corpus):
    assert _sandbox_uid_processes() == []
    assert list(Path(tempfile.gettempdir()).glob("grpo-sandbox-*")) == []
    # Two floods of 500 MB were read through a 64 KiB cap: the caller's peak memory barely moved.
    assert corpus["hwm_growth_kb"] < 64 * 1024


def test_binary_output_is_decoded_with_replacement(corpus):
    assert corpus[("probed", "binary_output")].result.stdout == "\ufffd\ufffd\x00ok"


def test_kill_attempts_fail_or_hit_only_the_sandbox(corpus):
    # In the PID namespace the parent is the sandbox's init (PID 1, immune to signals from inside) and kill(-1) reaches
    # only the namespace; in the fallback the parent is a root-owned init (EPERM) and kill(-1) reaches only the
    # run's own uid.
    assert corpus[("probed", "kill_parent_and_all")].result.stdout.endswith("survived\n")
    if FALLBACK_WORKS:
        assert corpus[("fallback", "kill_parent_and_all")].result.stdout == "PermissionError\nsurvived\n"


def test_probe_finds_namespaces_and_uid_drop_as_root():
    if os.geteuid() == 0:
        assert LAYERS.uid_drop
    assert os.access(LAYERS.interpreter, os.X_OK)
    assert "userns=" in LAYERS.describe() and "interpreter=" in LAYERS.describe()


def test_fails_closed_without_isolation():
    bare = SandboxLayers(userns=False, uid_drop=False, seccomp=False, interpreter=LAYERS.interpreter)
    assert not bare.isolated
    with pytest.raises(SandboxUnavailable, match="allow_unsandboxed=True"):
        run_sandboxed("print(1)", layers=bare)


def test_allow_unsandboxed_still_runs_with_limits():
    bare = SandboxLayers(userns=False, uid_drop=False, seccomp=False, interpreter=LAYERS.interpreter)
    result = run_sandboxed("print(6 * 7)", layers=bare, allow_unsandboxed=True, timeout_s=5.0)
    assert (result.status, result.stdout) == ("ok", "42\n")


def test_missing_interpreter_is_infra_error_not_a_program_failure():
    broken = dataclasses.replace(LAYERS, interpreter="/nonexistent/python3")
    result = run_sandboxed("print(1)", layers=broken, timeout_s=5.0)
    assert result.status == "infra_error" and result.returncode is None


def test_large_stdin_is_fed_and_an_unread_one_does_not_hang():
    data = "7\n" * 500_000  # 1 MB, far beyond a 64 KiB pipe buffer
    read = run_sandboxed("import sys\nprint(len(sys.stdin.read()))", data, timeout_s=5.0)
    assert (read.status, read.stdout) == ("ok", "1000000\n")
    ignored = run_sandboxed("print('no input needed')", data, timeout_s=5.0)
    assert (ignored.status, ignored.stdout) == ("ok", "no input needed\n")


def test_quit_builtin_exists_despite_dash_s():
    assert run_sandboxed("print('x')\nquit()\nprint('y')").stdout == "x\n"


def test_long_program_is_rejected_before_launch():
    result = run_sandboxed("x = 1\n" * 30_000)
    assert result.status == "error" and "longer than" in result.detail


def test_mount_points_keep_locked_flags_and_unescape_paths():
    mountinfo = (
        "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
        "28 27 0:25 / /mnt/my\\040dir ro,nosuid,nodev,relatime - tmpfs x ro\n"
        "29 27 0:26 / /srv noexec - tmpfs y rw\n"
    )
    # nosuid=2, nodev=4, noexec=8 (linux/mount.h); relatime is left to the kernel's "keep the atime flags" rule.
    assert _mount_points(mountinfo) == [("/", 0), ("/mnt/my dir", 6), ("/srv", 8)]


@pytest.mark.parametrize(("lines", "stopped", "stderr", "expected"), [
    (["exit 0"], None, b"", ("ok", 0)),
    (["exit 1"], None, b"Traceback...\nValueError: x\n", ("error", 1)),
    (["exit 1"], None, b"Traceback...\nMemoryError\n", ("oom", 1)),
    ([f"exit {-signal.SIGSEGV}"], None, b"", ("crashed", -signal.SIGSEGV)),
    ([f"exit {-signal.SIGXCPU}"], None, b"", ("timeout", -signal.SIGXCPU)),
    (["stopped"], "timeout", b"", ("timeout", None)),
    (["exit 0"], "output_limit", b"", ("output_limit", 0)),
    (["error in sandbox init: x", "exit 125"], None, b"", ("infra_error", 125)),
    ([], None, b"unshare: Operation not permitted", ("infra_error", None)),
])
def test_classify(lines, stopped, stderr, expected):
    assert _classify(lines, stopped, stderr)[:2] == expected
