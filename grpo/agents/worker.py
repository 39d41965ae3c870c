"""Plain tool functions run in worker processes, each call with a deadline; never in the trainer's process.

    workers = ToolWorkers({"calculator": calculator})      # forks its process now: make it before the model loads
    workers.run([("calculator", {"expression": "2 * 3"})], timeout_s=10, max_chars=2000)   # [("6", None)]

The functions are the user's own (a closure, a function in `__main__`, a notebook cell): they cannot be pickled by
reference into a fresh interpreter, so the workers are forked. What forks them is a small keeper process, forked
once when the pool is made (the trainer makes it before the model loads), that holds the functions and forks up to
`processes` workers from itself, so a worker never copies a trainer that holds a model and threads. Workers stay
alive between calls. A call that passes its deadline has its worker SIGKILLed (the next call gets a fresh one); a
tool that raises answers with the error's text; one that kills its process answers that it died; an answer longer
than `max_chars` is cut in the worker. Each answer comes back with its error kind (`grpo.agents.tools.ERROR_KINDS`)
or None. The arguments have been checked against the tool's schema before they get here.

The keeper and its workers exit when the pool is closed or the trainer's process ends (their pipe closes); they
ignore SIGINT, which a terminal sends to the whole process group.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing
import os
import signal
import sys
import time
import warnings
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Callable

from grpo.agents.tools import as_text, clip

logger = logging.getLogger(__name__)
_OPEN_POOLS: "weakref.WeakSet[ToolWorkers]" = weakref.WeakSet()  # their pipes are closed in every forked child
# A tool that touched CUDA in its forked worker after the trainer had started CUDA: the run stops with this answer
# (a tool error would go back to the model as an answer, every call failing silently; gpu_review2 N15).
FORKED_CUDA = "forked_cuda"


class ToolWorkers:
    """A keeper process and up to `processes` workers that run `functions` (name -> callable)."""

    def __init__(self, functions: dict[str, Callable], processes: int = 4):
        self.functions, self.processes = dict(functions), max(1, processes)
        self._keeper: dict = {"conn": None, "pid": None}  # (shared with the finalizer, which stops the keeper)
        self._start()
        _OPEN_POOLS.add(self)
        weakref.finalize(self, _stop_keeper, self._keeper)

    @property
    def _conn(self) -> Connection | None:
        return self._keeper["conn"]

    def _start(self) -> None:
        ours, theirs = multiprocessing.Pipe()
        pid = _fork([])
        if pid == 0:  # the keeper
            status = 0
            try:
                ours.close()
                _serve(theirs, self.functions, self.processes)
            except BaseException:  # noqa: BLE001 - whatever happens, never return into the trainer's code
                status = 1
            finally:
                os._exit(status)
        theirs.close()
        self._keeper.update(conn=ours, pid=pid)

    def run(self, calls: list[tuple[str, dict]], timeout_s: float, max_chars: int) -> list[tuple[str, str | None]]:
        """(answer text, error kind or None) for each (tool name, arguments) call, in order."""
        if not calls:
            return []
        rounds = -(-len(calls) // self.processes)
        try:
            self._conn.send((calls, timeout_s, max_chars))
            # Every call has its own deadline in the keeper; this one only guards against a keeper that died.
            if self._conn.poll(rounds * (timeout_s + 5.0) + 30.0):
                answers = self._conn.recv()
                refused = next((text for text, kind in answers if kind == FORKED_CUDA), None)
                if refused is not None:
                    raise RuntimeError(refused)
                return answers
        except (EOFError, OSError, BrokenPipeError):
            pass
        logger.warning("the tool keeper process stopped answering; starting a new one")
        self.close()
        self._start()
        return [(f"Error: the tool {name} could not be run (its worker process failed).", "raised")
                for name, _ in calls]

    def close(self) -> None:
        _stop_keeper(self._keeper)


def _stop_keeper(keeper: dict) -> None:
    _stop(keeper["conn"], keeper["pid"])
    keeper.update(conn=None, pid=None)


def _stop(conn: Connection | None, pid: int | None) -> None:
    if conn is not None:
        conn.close()
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def fork() -> int:
    """os.fork for grpo's worker processes (tools, episodes, the rollout worker), with Python's buffers flushed
    first (a child would write the parent's pending output again) and Python 3.12's warning about a fork of a
    process with other threads (torch's) silenced: each child starts the threads it needs."""
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork", category=DeprecationWarning)
        return os.fork()


def used_cuda_in_fork(err: BaseException) -> bool:
    """torch's error in a fork of a process that had initialised CUDA (a GPU run): the work needs CUDA there."""
    return "CUDA in forked subprocess" in str(err)


def leave_stops_to_the_trainer() -> None:
    """In a worker process: the signals a run may stop on (`stop_signals`' choices), sent to the whole process group,
    are the trainer's to handle (it checkpoints); the worker ignores them and dies with the trainer
    (`die_with_parent`), or when the trainer kills it."""
    from grpo.config.validate import STOP_SIGNALS

    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    die_with_parent()


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that forked it ends (its parent dies), even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _fork(inherited: list[Connection]) -> int:
    """`fork`; the child closes `inherited` and every pool's pipe to its keeper, so that each process at the other
    end of one sees EOF when its owner is gone."""
    pid = fork()
    if pid == 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for conn in inherited + [pool._conn for pool in list(_OPEN_POOLS) if pool._conn is not None]:
            conn.close()
    return pid


# ---- the keeper ---------------------------------------------------------------------------------------------------
class _Worker:
    def __init__(self, functions: dict[str, Callable], inherited: list[Connection]):
        ours, theirs = multiprocessing.Pipe()
        self.pid = _fork(inherited + [ours])
        if self.pid == 0:
            try:
                die_with_parent()
                _work(theirs, functions)
            finally:
                os._exit(0)
        theirs.close()
        self.conn = ours

    def kill(self) -> None:
        _stop(self.conn, self.pid)


def _serve(conn: Connection, functions: dict[str, Callable], processes: int) -> None:
    idle: list[_Worker] = []
    try:
        while True:
            try:
                calls, timeout_s, max_chars = conn.recv()
            except EOFError:
                return
            conn.send(_dispatch(calls, timeout_s, max_chars, functions, processes, idle, conn))
    finally:
        for worker in idle:
            worker.kill()


def _dispatch(calls, timeout_s: float, max_chars: int, functions, processes: int, idle: list[_Worker],
              keeper_conn: Connection) -> list[tuple[str, str | None]]:
    """Run the calls over at most `processes` workers; a worker past its call's deadline is killed."""
    results: list = [None] * len(calls)
    pending = deque(range(len(calls)))
    busy: dict[Connection, tuple[int, float, _Worker]] = {}
    while pending or busy:
        while pending and len(busy) < processes:
            index = pending.popleft()
            # (a new worker closes its copies of the keeper's other pipes)
            worker = idle.pop() if idle else _Worker(functions, [keeper_conn, *(w.conn for w in idle), *busy])
            worker.conn.send((calls[index][0], calls[index][1], max_chars))
            busy[worker.conn] = (index, time.monotonic() + timeout_s, worker)
        nearest = min(deadline for _, deadline, _ in busy.values())
        ready = wait(list(busy), timeout=max(0.0, nearest - time.monotonic()))
        for conn in ready:
            index, _, worker = busy.pop(conn)
            try:
                results[index] = conn.recv()
                idle.append(worker)
            except (EOFError, OSError):
                worker.kill()
                results[index] = (f"Error: the tool {calls[index][0]} ended its process without answering.",
                                  "raised")
        now = time.monotonic()
        for conn, (index, deadline, worker) in list(busy.items()):
            if deadline <= now and conn not in ready:
                del busy[conn]
                worker.kill()
                results[index] = (f"Error: the tool {calls[index][0]} did not answer within {timeout_s:g} s.",
                                  "timeout")
    return results


# ---- a worker -----------------------------------------------------------------------------------------------------
def _work(conn: Connection, functions: dict[str, Callable]) -> None:
    while True:
        try:
            name, arguments, max_chars = conn.recv()
        except EOFError:
            return
        try:
            value = functions[name](**arguments)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            answer = (clip(as_text(value), max_chars), None)
        except BaseException as err:  # noqa: BLE001 - SystemExit and KeyboardInterrupt of a tool are its errors too
            answer = (clip(f"Error: {name} raised {type(err).__name__}: {err}", max_chars), "raised")
            if used_cuda_in_fork(err):
                answer = (f"the tool {name} uses CUDA, but tools run in processes forked from the trainer's, where "
                          "CUDA cannot start once the trainer has (a GPU run); keep tools on the CPU (move any "
                          "model a tool calls to device 'cpu', or serve it from another process)", FORKED_CUDA)
        conn.send(answer)


async def _awaited(awaitable):
    return await awaitable
