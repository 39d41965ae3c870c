"""Run untrusted model-written Python in a local, dependency-free Linux sandbox (reliability.md 1.3-1.4).

    run_sandboxed("print(sum(map(int, input().split())))", "2 3\\n").stdout   # "5\\n"

Layers (`probe_sandbox()` finds, once, which work here and logs them):
  * uid drop: as root, each concurrent run gets its own uid from `SANDBOX_UIDS`: RLIMIT_NPROC does not bind root,
    and `kill(-1)` reaches every process of a shared uid (reliability.md 0.3, 1.4).
  * userns: util-linux `unshare` gives an empty network, a PID namespace (the trainer is invisible; everything dies
    with the namespace's init) and a mount namespace where every mount is read-only and a fresh capped tmpfs is the
    working directory, /tmp and /dev/shm. The program runs with no capabilities.
  * seccomp (libseccomp via ctypes, like pyseccomp): no socket() but AF_UNIX, no ptrace, mount, unshare/setns,
    namespace clone flags, bpf, io_uring, keyctl, ... (Docker's default list; Piston's `nosocket`).
  * always: rlimits (address space, CPU, file size, open files, processes, no core), a scrubbed environment,
    `python -I -S` (stdlib only), a new session, output read with a byte cap, a wall deadline, nothing left running.
Without userns (Docker's default seccomp profile blocks it) a run keeps the uid drop, seccomp, rlimits and a private
temp dir, and a janitor SIGKILLs every process of its uid; world-writable host dirs (/tmp) stay writable then.
With neither userns nor (uid drop and seccomp), `SandboxUnavailable` unless `allow_unsandboxed=True` (fail closed).
The interpreter must be readable by the sandbox uid: `sys.executable` if so (a pyenv or venv under a 0700 /root is
not), else /usr/bin/python3. Not covered: kernel exploits (use a VM such as E2B) and reading world-readable files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# 1024 host uids, in 16 blocks of 64: a trainer process takes the block chosen by its pid and one uid of it per
# concurrent run. 60100-61123 lies below systemd's dynamic range (61184-65519) and above regular users.
SANDBOX_UIDS = range(60100, 60100 + 16 * 64)
_UID_BLOCK = 64
_MAX_ARG_BYTES = 131072 - 1  # Linux MAX_ARG_STRLEN: the program travels as one argv string
_STOP_GRACE_S = 5.0
_FALLBACK_INTERPRETER = "/usr/bin/python3"


class SandboxUnavailable(RuntimeError):
    """No isolation layer works here, and the caller did not pass `allow_unsandboxed=True`."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run did. The caller judges the output; nothing is compared inside the sandbox.

    status: "ok" (exit 0), "error" (non-zero exit), "timeout" (wall deadline or CPU limit), "oom" (MemoryError),
        "crashed" (killed by a signal), "output_limit" (stdout or stderr over the cap; run stopped), or
        "infra_error" (the sandbox failed, so the program's merit is unknown: a reward should be None, not 0).
    returncode: the program's exit code, negative for a signal, None when it never finished.
    """

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    wall_s: float
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class SandboxLayers:
    """Which layers a run uses. `probe_sandbox()` returns the best that works here; tests may force a weaker one."""

    userns: bool
    uid_drop: bool
    seccomp: bool
    interpreter: str

    @property
    def isolated(self) -> bool:
        # A network barrier and a process barrier: namespaces, or a foreign uid plus seccomp's socket filter.
        return self.userns or (self.uid_drop and self.seccomp)

    def describe(self) -> str:
        flags = {"userns": self.userns, "uid_drop": self.uid_drop, "seccomp": self.seccomp}
        return " ".join(f"{k}={'yes' if v else 'no'}" for k, v in flags.items()) + f" interpreter={self.interpreter}"


def run_sandboxed(code: str, stdin: str = "", *, timeout_s: float = 3.0, memory_mb: int = 512,
                  max_output_bytes: int = 65536, max_processes: int = 32, file_size_mb: int = 16, tmpfs_mb: int = 64,
                  layers: SandboxLayers | None = None, allow_unsandboxed: bool = False) -> SandboxResult:
    """Run `code` as `python -I -S` with `stdin`; return within about `timeout_s` with nothing left running.

    memory_mb bounds each process's address space (so a fork bomb may use up to max_processes * memory_mb);
    max_processes counts every process and thread of the run, the sandbox's own init included; file_size_mb bounds
    one written file, tmpfs_mb the private /tmp. Thread-safe: run several at once from a thread pool.
    """
    layers = layers or probe_sandbox()
    if not (layers.isolated or allow_unsandboxed):
        raise SandboxUnavailable(unavailable_message(layers))
    try:
        too_long = len(code.encode("utf-8", "surrogateescape")) > _MAX_ARG_BYTES
    except UnicodeEncodeError:  # a lone surrogate cannot travel in argv
        return SandboxResult("error", "", "", None, 0.0, "program is not encodable as UTF-8")
    if too_long:
        return SandboxResult("error", "", "", None, 0.0, f"program longer than {_MAX_ARG_BYTES} bytes")
    settings = {"userns": int(layers.userns), "seccomp": int(layers.seccomp), "tmpfs_mb": tmpfs_mb,
                "interpreter": layers.interpreter, "as": memory_mb << 20, "cpu": math.ceil(timeout_s) + 1,
                "fsize": file_size_mb << 20, "nofile": 64, "nproc": max_processes, "core": 0}
    start = time.monotonic()
    with (_lease_uid() if layers.uid_drop else contextlib.nullcontext(None)) as uid, _workdir(layers, uid) as workdir:
        try:
            out, err, lines, stopped = _spawn_and_collect(
                layers, uid, workdir, settings, code, stdin.encode("utf-8", "replace"), start + timeout_s,
                max_output_bytes)
        except OSError as exc:  # setpriv/unshare/interpreter missing, fork failed, ...
            return SandboxResult("infra_error", "", "", None, time.monotonic() - start, f"launch failed: {exc}")
    status, returncode, detail = _classify(lines, stopped, err)
    text = (out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
    return SandboxResult(status, *text, returncode, time.monotonic() - start, detail)


def unavailable_message(layers: SandboxLayers) -> str:
    return (f"no code sandbox can be set up here ({layers.describe()}): model code would run with the trainer's "
            "identity and network. Run as root with util-linux setpriv/unshare and libseccomp2, or allow unprivileged "
            "user namespaces (Docker: a seccomp profile that permits unshare); as root, /usr/bin/python3 must exist "
            "unless sys.executable is readable by other users. Or pass allow_unsandboxed=True to run untrusted code "
            "anyway.")


@functools.lru_cache(maxsize=1)
def probe_sandbox() -> SandboxLayers:
    """The strongest layer set that actually runs a program here; checked once per process, then cached.

    Each candidate runs a program that reports its own capabilities, no_new_privs and seccomp mode, so a layer that
    silently did not apply is not reported as present.
    """
    root = os.geteuid() == 0
    candidates = [p for p in (sys.executable, _FALLBACK_INTERPRETER) if p and os.path.exists(p)]
    for interpreter in dict.fromkeys(candidates):
        for userns, seccomp in ((True, True), (True, False), (False, True)):
            layers = SandboxLayers(userns=userns, uid_drop=root, seccomp=seccomp, interpreter=interpreter)
            if _layers_work(layers):
                logger.info("code sandbox layers: %s", layers.describe())
                return layers
    layers = SandboxLayers(userns=False, uid_drop=False, seccomp=False, interpreter=sys.executable)
    logger.warning("code sandbox: %s", unavailable_message(layers))
    return layers


_PROBE_PROGRAM = """
fields = dict(line.split(':', 1) for line in open('/proc/self/status') if ':' in line)
print(int(fields['CapEff'], 16), fields['NoNewPrivs'].strip(), fields['Seccomp'].strip())
"""


def _layers_work(layers: SandboxLayers) -> bool:
    result = run_sandboxed(_PROBE_PROGRAM, layers=layers, allow_unsandboxed=True, timeout_s=10.0)
    works = result.status == "ok" and result.stdout.split() == ["0", "1", "2" if layers.seccomp else "0"]
    if not works:
        logger.debug("sandbox layers %s fail: %s %s %r", layers.describe(), result.status, result.detail,
                     result.stdout + result.stderr)
    return works


_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


@contextlib.contextmanager
def _lease_uid():
    """A host uid no other live run of this process uses (RLIMIT_NPROC and the kill(-1) janitor are per uid)."""
    # The block follows the pid so that trainer processes on one machine (DDP ranks) mostly use different uids.
    first = SANDBOX_UIDS.start + (os.getpid() % (len(SANDBOX_UIDS) // _UID_BLOCK)) * _UID_BLOCK
    with _uid_lock:
        uid = next((u for u in range(first, first + _UID_BLOCK) if u not in _uids_in_use), None)
        if uid is None:
            raise RuntimeError(f"run_sandboxed: more than {_UID_BLOCK} concurrent runs in one process")
        _uids_in_use.add(uid)
    try:
        yield uid
    finally:
        with _uid_lock:
            _uids_in_use.discard(uid)


@contextlib.contextmanager
def _workdir(layers: SandboxLayers, uid: int | None):
    """The working directory: a tmpfs made inside the mount namespace, or a private host temp dir removed after."""
    if layers.userns:
        yield "/tmp"
        return
    path = tempfile.mkdtemp(prefix="grpo-sandbox-")
    try:
        if uid is not None:
            os.chown(path, uid, uid)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _command(layers: SandboxLayers, uid: int | None, settings: dict, code: str) -> list[str]:
    init = [layers.interpreter, "-I", "-S", "-c", _init_source(), *(f"{k}={v}" for k, v in settings.items()), "--", code]
    if not layers.userns:
        return init  # init starts as the caller (root) and drops the program to `uid` itself, so it cannot be killed
    namespaces = ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount",
                  "--mount-proc", "--ipc", "--uts", "--"]
    if uid is None:
        return namespaces + init
    # The user namespace must belong to the unprivileged uid, so setpriv drops to it before unshare runs.
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"] + namespaces + init


def _spawn_and_collect(layers, uid, workdir, settings, code, stdin, deadline, cap):
    """Start the sandbox, feed stdin, read capped output until it finishes or the deadline, then stop it."""
    status_r, status_w = os.pipe()
    control_r, control_w = os.pipe()
    # With namespaces, setpriv already dropped the uid (uid=-1); without, init drops the program to it.
    settings = {**settings, "status_fd": status_w, "control_fd": control_r,
                "uid": -1 if layers.userns or uid is None else uid}
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir,
           "TMPDIR": workdir}
    try:
        proc = subprocess.Popen(
            _command(layers, uid, settings, code), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(status_w, control_r), cwd="/" if layers.userns else workdir, env=env,
            start_new_session=True,
        )
    except BaseException:
        os.close(status_r)
        os.close(control_w)
        raise
    finally:
        os.close(status_w)
        os.close(control_r)
    try:
        out, err, status, stopped = _collect(proc, stdin, status_r, deadline, cap)
    finally:
        os.close(control_w)  # init sees EOF, kills the program tree and exits
        _reap(proc)
        os.close(status_r)
    return out, err, status.decode("utf-8", "replace").splitlines(), stopped


def _collect(proc, stdin: bytes, status_fd: int, deadline: float, cap: int):
    """Read stdout/stderr (each up to `cap` bytes) and the status pipe until all close. (out, err, status, stopped)."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), status_fd: bytearray()}
    pending = memoryview(stdin)
    stopped = None
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while sel.get_map() and stopped is None:
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = "timeout"
                break
            for key, _ in sel.select(left):
                if key.fd not in bufs:
                    pending = _feed(sel, proc.stdin, pending)
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                bufs[key.fd] += chunk
                if key.fd != status_fd and len(bufs[key.fd]) > cap:
                    stopped = "output_limit"
    proc.stdin.close()
    out, err = (bytes(bufs[f.fileno()][:cap]) for f in (proc.stdout, proc.stderr))
    proc.stdout.close()
    proc.stderr.close()
    return out, err, bytes(bufs[status_fd]), stopped


def _feed(sel, pipe, pending: memoryview) -> memoryview:
    try:
        pending = pending[os.write(pipe.fileno(), pending[:65536]):]
    except BrokenPipeError:  # the program exited or closed stdin without reading it all
        pending = pending[:0]
    if not pending:
        sel.unregister(pipe.fileno())
        pipe.close()
    return pending


def _reap(proc) -> None:
    """Wait for the sandbox's outer process. It exits only after its PID namespace (or uid janitor) is empty."""
    try:
        proc.wait(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:  # init itself is stuck: kill the session; --kill-child takes the namespace
        logger.warning("sandbox init did not stop within %.0f s; killing its session", _STOP_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _classify(lines: list[str], stopped: str | None, stderr: bytes) -> tuple[str, int | None, str]:
    """(status, returncode, detail) from init's status lines, the host's stop reason and the program's stderr."""
    errors = [line[len("error "):] for line in lines if line.startswith("error ")]
    exits = [int(line.split()[1]) for line in lines if line.startswith("exit ")]
    returncode = exits[0] if exits else None
    if errors:
        return "infra_error", returncode, "; ".join(errors)
    if stopped is not None:
        return stopped, returncode, ""
    if returncode is None:
        return "infra_error", None, f"sandbox ended without a status ({stderr[-300:].decode('utf-8', 'replace')!r})"
    if returncode == 0:
        return "ok", 0, ""
    if returncode == -signal.SIGXCPU:
        return "timeout", returncode, "CPU time limit"
    if stderr.rstrip().rsplit(b"\n", 1)[-1].startswith(b"MemoryError"):
        return "oom", returncode, ""
    return ("crashed" if returncode < 0 else "error"), returncode, ""


@functools.lru_cache(maxsize=1)
def _init_source() -> str:
    """`sandbox_init.py`, which the sandbox's interpreter runs as its first process."""
    return (Path(__file__).parent / "sandbox_init.py").read_text() + "\n_init_main(sys.argv[1:])\n"
