"""One run per directory at a time: `output_dir/.grpo.lock` names the run that holds it (host, pid, start).

Train, resume and overwrite take it before they touch the directory, and give it back when train() ends; only the
main process of a launch takes it (the others write where the main process says, and a lock per process would
refuse the run's own processes). A lock whose holder is no longer running on this host (its pid gone, or reused by
a process that started later) is stale and taken over, saying so; a kill -9 leaves such a lock. A holder on another
host cannot be checked from here: the message says to delete the file once that run is gone.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from grpo.config import ConfigError

LOCK = ".grpo.lock"


def _started(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (/proc, Linux), to tell a reused pid apart."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(holder: dict) -> bool:
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process: it exists)
        pass
    started = _started(holder["pid"])
    return started is None or holder.get("started") in (None, started)


def _mine() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check(out: Path) -> None:
    """Before the model loads (25-34 s for a 0.5B one): a refusal take() would give, given now in one line
    (ConfigError): `out` (or the nearest part of it that exists) is a file or is not writable, or a live run holds
    its lock. take() still decides: this only answers early and writes nothing."""
    writable(out, "output_dir")
    if os.environ.get("RANK", "0") != "0":  # (the main process of a launch takes the lock, and judges it)
        return
    holder = _read(out / LOCK)
    refusal = holder and _refusal(out, holder, _mine())
    if refusal:
        raise ConfigError(refusal)


def writable(path: Path, key: str) -> None:
    """`path` is a directory this process can write into, or can make one (ConfigError naming `key` otherwise)."""
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}: {existing} is a file, not a directory; choose another {key}.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {existing} is not writable (read-only, or another user's); choose a directory "
                          "you can write to.")


def _refusal(out: Path, holder: dict, me: dict) -> str | None:
    """Why `holder`'s lock on `out` refuses this process (None: it is this process's, or its holder is gone)."""
    if (holder.get("host"), holder.get("pid")) == (me["host"], me["pid"]):
        return None
    if holder.get("host") == me["host"] and not _alive(holder):
        return None
    where = "this host" if holder.get("host") == me["host"] else f"host {holder.get('host')}"
    return (f"output_dir: {out} is in use by a run still going (pid {holder.get('pid')} on {where}, since "
            f"{holder.get('since')}); wait for it to end or choose another output_dir (if that run is gone, delete "
            f"{out / LOCK}).")


def take(out: Path) -> None:
    """Hold output_dir `out` for this process (again, if it holds it already), or refuse in one line naming the
    holder (ConfigError)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"output_dir: cannot create {out} ({err.strerror}); choose a directory you can write "
                          "to.") from None
    path, me = out / LOCK, _mine()
    for _ in range(3):  # (a stale lock removed, or one that went away as we read it: try again)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None:  # being written this instant, or cut short by a crash: judged by its age
                if time.time() - _mtime(path) < 10:
                    raise ConfigError(f"output_dir: {out} is being claimed by another run ({path}); choose another "
                                      "output_dir, or wait for that run to finish.") from None
                _remove(path)
                continue
            if (holder.get("host"), holder.get("pid")) == (me["host"], me["pid"]):
                return  # (this process: a second train(), or a pid of a dead container's run reused by ours)
            if holder.get("host") == me["host"] and not _alive(holder):
                print(f"output_dir: taking over {path} from pid {holder.get('pid')}, which is no longer running.")
                _remove(path)
                continue
            raise ConfigError(_refusal(out, holder, me)) from None
        except OSError as err:  # (a read-only directory, a full disk)
            raise ConfigError(f"output_dir: cannot write {path} ({err.strerror}); choose a directory you can "
                              "write to.") from None
        with os.fdopen(fd, "w") as fh:
            json.dump(me, fh)
        return
    raise ConfigError(f"output_dir: could not take {path}: other runs keep claiming it; choose another output_dir.")


def release(out: Path) -> None:
    """Give `out` back, if this process holds it."""
    path = out / LOCK
    holder = _read(path)
    if holder is not None and (holder.get("host"), holder.get("pid")) == (socket.gethostname(), os.getpid()):
        _remove(path)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
