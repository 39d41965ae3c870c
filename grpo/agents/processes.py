"""Episodes in processes of their own (`Episodes(episode, processes=N)`, grpo.agents.episodes).

An agent's requests cost CPU on the client's side (the openai client's pydantic objects, httpx): with the episodes on
threads of the trainer's process, 64 of them fight the endpoint's handlers and the engine for the interpreter lock,
and on a GPU the engine's kernel launches wait for it. With N >= 1 a step's episodes are split over N worker
processes, which run them as the trainer's process would (grpo.agents.episodes.run_episodes: one shared HTTP client
a step, sync episodes on threads, async ones on one event loop, each with its deadline) against the same endpoint,
which stays in the trainer's process with the engine.

The workers are forked once, at the first rollout (before the endpoint's threads start), and live across steps.
They die with the process that forked them (PR_SET_PDEATHSIG, and the end of their pipe), ignore the stop signals
the trainer handles, and never touch CUDA: a fork of a process that initialised CUDA must not use it (torch refuses
it there; an episode that tries stops the run with an error saying so). Rows go to a worker pickled; each episode's
(key, return value, fault) comes back pickled as it ends, so the endpoint's batcher learns at once that it ended. A
return value that cannot be pickled is the episode's `bad_return`; a worker that dies mid-step has its unfinished
episodes counted as `worker_died` and is forked again at the next rollout; a worker silent past the episodes'
deadline plus MARGIN_S is killed, its unfinished episodes counted as `timeout`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import pickle
import signal
import time
import weakref
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Callable

from grpo.agents.worker import fork, leave_stops_to_the_trainer

logger = logging.getLogger(__name__)
MARGIN_S = 10.0  # past the episodes' deadline, a worker that has not reported them all is killed
WORKER_DIED = "worker_died"
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class _Worker:
    def __init__(self, pid: int, conn: Connection):
        self.pid, self.conn = pid, conn
        self.status: int | None = None  # (its wait status, once reaped)

    def alive(self) -> bool:
        if self.status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid:
                self.status = status
        return self.status is None

    def kill(self) -> str:
        """Kill it (if it still runs) and reap it; how it ended, in words."""
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
                self.status = os.waitpid(self.pid, 0)[1]
            except (ProcessLookupError, ChildProcessError):
                self.status = 0
        self.conn.close()
        if os.WIFSIGNALED(self.status):
            return f"killed by {signal.Signals(os.WTERMSIG(self.status)).name}"
        return f"ended (exit status {os.WEXITSTATUS(self.status)})"


class EpisodeWorkers:
    """`n` worker processes running `run(spec, jobs, token, ended)`'s episodes (see the module's docstring): `run` is
    grpo.agents.episodes.run_episodes, called in the worker with `ended(key, value, fault)` sending each result."""

    def __init__(self, spec, n: int, run: Callable):
        self.spec, self.n, self._run = spec, n, run
        self.workers: list[_Worker | None] = [None] * n
        self.owner = os.getpid()
        weakref.finalize(self, _kill_all, self.workers)

    def ready(self) -> None:
        """Fork the workers that are not running (all at the first rollout; one that died, again). Call it before
        the endpoint's threads start: a fork copies only the calling thread."""
        if os.getpid() != self.owner:  # (a fork of the process that made them: theirs, not ours)
            self.workers[:] = [None] * self.n
            self.owner = os.getpid()
        for w, worker in enumerate(self.workers):
            if worker is not None and not worker.alive():  # (died between rollouts: killed, out of memory)
                logger.warning("episodes: worker process %d %s between rollouts; forking a new one", w, worker.kill())
                self.workers[w] = None
            if self.workers[w] is None:
                self.workers[w] = self._fork()

    def _fork(self) -> _Worker:
        ours, theirs = Pipe()
        others = [w.conn for w in self.workers if w is not None]
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # (the child's copy: no warning, no pool it lacks threads for)
        pid = -1
        try:
            pid = fork()
        finally:
            if pid != 0:
                _restore("TOKENIZERS_PARALLELISM", saved)
        if pid == 0:  # the worker: never returns into the trainer's code
            code = 0
            gc.freeze()  # (the trainer's objects: its collections never walk them, so their pages stay shared)
            try:
                for conn in [ours, *others]:  # (so that each worker sees its pipe's end when the trainer is gone)
                    conn.close()
                _serve(theirs, self.spec, self._run)
            except BaseException:  # noqa: BLE001 - the trainer counts its episodes as worker_died
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        return _Worker(pid, ours)

    def run(self, jobs: list[tuple[str, str, dict]], token: str | None,
            ended: Callable[[], None]) -> list[tuple[object, str | None]]:
        """(value, fault) of each job (key, url, row), in order; `ended()` is called as each episode ends."""
        where = {key: k for k, (key, _, _) in enumerate(jobs)}
        outcomes: list = [None] * len(jobs)
        running: dict[Connection, tuple[int, set]] = {}
        parts = {w: _pickled_jobs(jobs[w::self.n], token) for w in range(self.n) if jobs[w::self.n]}  # (all first)
        for w, data in parts.items():
            conn = self.workers[w].conn
            running[conn] = (w, {key for key, _, _ in jobs[w::self.n]})
            try:
                conn.send_bytes(data)
            except OSError:  # (it died since `ready`)
                self._lost(conn, running, outcomes, where, ended, WORKER_DIED)
        deadline = time.monotonic() + self.spec.timeout_s + MARGIN_S
        while running:
            ready = wait(list(running), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:  # past the deadline: the workers still running are stuck (a blocked event loop)
                for conn in list(running):
                    self._lost(conn, running, outcomes, where, ended, "timeout")
                break
            for conn in ready:
                try:
                    key, fault, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._lost(conn, running, outcomes, where, ended, WORKER_DIED)
                    continue
                outcomes[where[key]] = _unpickled(key, value, fault)
                ended()
                unfinished = running[conn][1]
                unfinished.discard(key)
                if not unfinished:
                    del running[conn]
        return outcomes

    def _lost(self, conn, running: dict, outcomes: list, where: dict, ended: Callable, fault: str) -> None:
        """A worker died or is stuck: it is killed, its unfinished episodes get `fault`; forked again next rollout."""
        w, unfinished = running.pop(conn)
        how = self.workers[w].kill()
        self.workers[w] = None
        logger.warning("episodes: worker process %d (%s) with %d episode(s) unfinished (%s): counted as "
                       "episodes/%s; a new worker is forked at the next rollout", w, how, len(unfinished),
                       ", ".join(sorted(unfinished)), fault)
        for key in unfinished:
            outcomes[where[key]] = (None, fault)
            ended()

    def cpu_seconds(self) -> float:
        """CPU seconds the live workers have used (Linux; 0 elsewhere): the endpoint's batcher counts their work on
        requests as busy, as it counts the episodes' threads in the trainer's process."""
        total = 0.0
        for worker in list(self.workers):
            if worker is not None:
                try:
                    with open(f"/proc/{worker.pid}/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                    total += (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime, all its threads
                except (OSError, IndexError, ValueError):
                    pass
        return total

    def close(self) -> None:
        _kill_all(self.workers)


def _pickled_jobs(jobs: list[tuple[str, str, dict]], token: str | None) -> bytes:
    try:
        return pickle.dumps((jobs, token), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as err:  # noqa: BLE001 - named per row below
        for key, _, row in jobs:
            try:
                pickle.dumps(row)
            except Exception as row_err:  # noqa: BLE001
                raise ValueError(f"Episodes(processes=...): the row of episode {key} cannot be pickled for its "
                                 f"worker process ({type(row_err).__name__}: {row_err}); give rows of plain "
                                 "values, or processes=0.") from None
        raise ValueError(f"Episodes(processes=...): a step's rows cannot be pickled ({err})") from None


def _unpickled(key: str, value: bytes, fault: str | None) -> tuple[object, str | None]:
    try:
        return pickle.loads(value), fault
    except Exception as err:  # noqa: BLE001 - the agent's value (a class the trainer cannot import); counted
        logger.warning("episode %s: its return value cannot be unpickled in the trainer (%s: %s)", key,
                       type(err).__name__, err)
        return None, fault or "bad_return"


def _serve(conn: Connection, spec, run: Callable) -> None:
    """The worker's loop: each message is a step's jobs, run as the trainer's process would run them; each
    episode's (key, value, fault) is sent as it ends (an unpicklable value: bad_return)."""
    leave_stops_to_the_trainer()  # (dies when the thread that forked it ends: the trainer's, or its rollouts')

    def send(key: str, value, fault: str | None) -> None:
        try:  # (the value pickled on its own: the trainer reads the key and fault whatever it holds)
            value = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - the agent's value; the run goes on
            logger.warning("episode %s: its return value cannot be pickled back to the trainer (%s: %s)", key,
                           type(err).__name__, err)
            value, fault = pickle.dumps(None), fault or "bad_return"
        conn.send_bytes(pickle.dumps((key, fault, value), protocol=pickle.HIGHEST_PROTOCOL))

    while True:
        try:
            jobs, token = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        asyncio.run(run(spec, jobs, token, send))


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _kill_all(workers: list) -> None:
    for k, worker in enumerate(workers):
        if worker is not None:
            worker.kill()
            workers[k] = None
