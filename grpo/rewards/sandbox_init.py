"""The sandbox's first process: `sandbox.run_sandboxed` runs this whole file as `python -I -S -c <file> settings --
code`, so it must stay self-contained (no grpo imports) and import only cheap built-in modules: json or re would add
about 25 ms to every run. As PID 1 of the namespace it cannot be signalled by the program, forks the program, waits
for it or for the host's stop (EOF on the control pipe), and writes one status line ("exit N" or "error ...") to the
status pipe.
"""

import ctypes
import os
import resource
import select
import sys

_PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = (
    38, 24, 36, 47, 4)
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
# A bind remount must repeat these per-mount flags when they are locked (inherited into a user namespace).
_KEPT_MOUNT_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC}
_SCMP_ACT_ALLOW, _SCMP_ACT_ERRNO, _SCMP_CMP_NE, _SCMP_CMP_MASKED_EQ = 0x7FFF0000, 0x00050000, 1, 7
_EPERM, _ENOSYS, _AF_UNIX = 1, 38, 1
_DENIED_SYSCALLS = (
    "ptrace process_vm_readv process_vm_writev unshare setns mount umount2 pivot_root chroot fsopen fsmount fsconfig "
    "move_mount open_tree mount_setattr bpf perf_event_open keyctl add_key request_key io_uring_setup io_uring_enter "
    "io_uring_register userfaultfd open_by_handle_at name_to_handle_at kexec_load kexec_file_load init_module "
    "finit_module delete_module swapon swapoff reboot acct quotactl").split()
# CLONE_NEWUSER, NEWNS, NEWNET, NEWPID, NEWIPC, NEWUTS, NEWCGROUP.
_NAMESPACE_CLONE_FLAGS = (0x10000000, 0x00020000, 0x40000000, 0x20000000, 0x08000000, 0x04000000, 0x02000000)
_RLIMITS = {"as": resource.RLIMIT_AS, "cpu": resource.RLIMIT_CPU, "fsize": resource.RLIMIT_FSIZE,
            "nofile": resource.RLIMIT_NOFILE, "nproc": resource.RLIMIT_NPROC, "core": resource.RLIMIT_CORE}
# `-S` skips site, which is what defines exit() and quit(); solutions call them, so the prelude restores them.
_PROGRAM_PRELUDE = ("import builtins as _b, sys as _s\n_b.exit = _b.quit = _s.exit\n"
                    "_c = compile(_s.argv.pop(1), '<program>', 'exec')\ndel _b, _s\nexec(_c)\n")


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _mount_points(mountinfo: str) -> list:
    """[(mount point, flags a remount must keep)] from /proc/self/mountinfo (fields 5 and 6, octal escapes)."""
    points = []
    for line in mountinfo.splitlines():
        fields = line.split()
        path = fields[4]
        for escape, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
            path = path.replace(escape, char)
        points.append((path, sum(_KEPT_MOUNT_FLAGS.get(option, 0) for option in set(fields[5].split(",")))))
    return points


def _mount(libc, source, target, fstype, flags, data) -> None:
    args = [None if a is None else os.fsencode(a) for a in (source, target, fstype, data)]
    if libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _isolate_filesystem(libc, tmpfs_mb: int) -> None:
    """Make every mount read-only, then give /tmp and /dev/shm fresh capped tmpfs; cwd /tmp."""
    with open("/proc/self/mountinfo") as f:
        points = _mount_points(f.read())
    for path, flags in points:
        _mount(libc, None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags, None)
    for path in ("/tmp", "/dev/shm"):
        if os.path.isdir(path):  # nr_inodes: empty files cost kernel memory but no tmpfs size
            _mount(libc, "tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={tmpfs_mb}m,nr_inodes=4096,mode=1777")
    os.chdir("/tmp")


def _drop_capabilities(libc) -> None:
    """Empty the bounding set so exec as namespace-root grants nothing; fail if any capability would survive."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        caps = range(int(f.read()) + 1)
    for cap in caps:
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"cannot drop capability {cap}")
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    with open("/proc/self/status") as f:
        caps = {k: int(v, 16) for k, v in (line.split(":", 1) for line in f) if k in ("CapInh", "CapAmb", "CapBnd")}
    if any(caps.values()):
        raise OSError(f"capabilities survive the drop: {caps}")


def _load_seccomp() -> None:
    """Install the syscall filter (libseccomp via ctypes; kept across exec)."""
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)

    def deny(name, errno=_EPERM, *cmps):
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # unknown to this libseccomp or architecture: nothing to deny
            return
        array = (_ArgCmp * len(cmps))(*cmps) if cmps else None
        if lib.seccomp_rule_add_array(ctx, _SCMP_ACT_ERRNO | errno, number, len(cmps), array) != 0:
            raise OSError(f"seccomp rule for {name} rejected")

    for name in _DENIED_SYSCALLS:
        deny(name)
    deny("clone3", _ENOSYS)  # clone3 hides its flags from seccomp; ENOSYS makes libc fall back to clone
    for flag in _NAMESPACE_CLONE_FLAGS:
        deny("clone", _EPERM, _ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag))
    deny("socket", _EPERM, _ArgCmp(0, _SCMP_CMP_NE, _AF_UNIX, 0))
    if lib.seccomp_load(ctx) != 0:
        raise OSError("seccomp_load failed")


def _enter_program(libc, settings: dict, code: str, report) -> None:
    """In the forked child: limits, identity, capabilities, filter, then exec the program. Never returns."""
    try:
        if settings["userns"] == "1":
            os.setsid()  # kill(0, ...) then reaches only the program's own group
        for name, limit in _RLIMITS.items():
            resource.setrlimit(limit, (int(settings[name]), int(settings[name]) + (name == "cpu")))
        uid = int(settings["uid"])
        if uid >= 0:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "no_new_privs")
        if settings["userns"] == "1":
            _drop_capabilities(libc)
        if settings["seccomp"] == "1":
            _load_seccomp()
        interpreter = settings["interpreter"]
        os.execv(interpreter, [interpreter, "-I", "-S", "-c", _PROGRAM_PRELUDE, code])
    except BaseException as exc:  # noqa: BLE001  any failure here is the sandbox's, reported as infra_error
        report(f"error setting up the program: {exc!r}")
    finally:
        os._exit(125)


def _wait_program(pid: int, control_fd: int) -> str:
    """"exit N" (negative N: signal) once the program ends, or "stopped" when the host closes the control pipe."""
    pidfd = os.pidfd_open(pid)
    ready = select.select([pidfd, control_fd], [], [])[0]
    if pidfd not in ready:
        return "stopped"
    return f"exit {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}"


def _kill_leftovers(uid: int) -> None:
    """Without a PID namespace: SIGKILL every process of the run's own uid (Piston's janitor) until this init, a
    child subreaper that inherits every orphaned descendant, has no child left, so nothing outlives the run."""
    if uid < 0:  # unsandboxed and not root: only the session can be reached (this init included)
        os.killpg(0, 9)
        return
    for _ in range(200):  # children forked while a pass runs survive it; a few passes catch them (NPROC bounds them)
        helper = os.fork()
        if helper == 0:
            try:
                os.setresuid(uid, uid, uid)
                os.kill(-1, 9)
            finally:
                os._exit(0)
        os.waitpid(helper, 0)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        select.select([], [], [], 0.01)


def _init_main(argv: list) -> None:
    split = argv.index("--")
    settings = dict(item.split("=", 1) for item in argv[:split])
    status_fd, control_fd = int(settings["status_fd"]), int(settings["control_fd"])
    for fd in (status_fd, control_fd):
        os.set_inheritable(fd, False)  # the program must not reach either pipe

    def report(line: str) -> None:
        os.write(status_fd, (line + "\n").encode())

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if settings["userns"] == "1":
            _isolate_filesystem(libc, int(settings["tmpfs_mb"]))
        elif libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "cannot become a child subreaper")
        pid = os.fork()
        if pid == 0:
            _enter_program(libc, settings, argv[split + 1], report)
        report(_wait_program(pid, control_fd))
    except Exception as exc:  # noqa: BLE001  reported as infra_error, never as the program's failure
        report(f"error in sandbox init: {exc!r}")
    finally:
        if settings["userns"] != "1":
            _kill_leftovers(int(settings["uid"]))
