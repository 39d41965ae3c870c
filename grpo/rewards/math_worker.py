"""math-verify in a separate process that can be killed.

math-verify bounds its own work with `signal.alarm`: whole seconds, main thread only (TRL turns it off elsewhere),
and some inputs hang even in the main thread (Math-Verify#65; `str()` of a huge integer cannot be interrupted,
sympy#24187). reliability.md section 2.2 measured hangs of more than 90 s. So the check runs in a child process:
the parent gives each request a hard deadline and, when it passes, kills the child (SIGKILL) and starts a new one
on the next request. math-verify's own alarms stay on inside the child (its main thread) as the cheap first
timeout, and RLIMIT_AS caps the child's memory.

The child is `python -c <bootstrap> <this file>`, not `multiprocessing`: spawn would re-import the user's main
script, and fork would copy a trainer that holds threads and a model. This file imports only the standard library
at the top so that the child starts without importing torch or `grpo`.

Protocol: one JSON line per request on the child's stdin, `{"gold": [...], "pred": [...], "anchored": bool,
"t": seconds}` (candidate strings, the first that parses wins; `anchored`: the prediction is a whole completion, so
only anchored answers count, as in TRL's `accuracy_reward`), and one JSON line per reply on the protocol pipe,
`{"r": true | false | null}` (null: no gold candidate parses).
"""

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time

# Drops '' (the working directory) from sys.path, so that a user's `sympy.py` or `code.py` there shadows nothing.
_BOOTSTRAP = (
    "import runpy, sys; sys.path = [p for p in sys.path if p]; runpy.run_path(sys.argv.pop(1), run_name='__main__')"
)
DEFAULT_MEMORY_BYTES = 2 << 30

logger = logging.getLogger(__name__)


class WorkerFailed(RuntimeError):
    """The worker process could not be started (for example math-verify is not installed)."""


class MathVerifyWorker:
    """A persistent math-verify child process with a per-request deadline.

    `check(requests, timeout_s)` returns, per request, True / False / None (gold unparseable). A request that
    passes its deadline, or kills the child, counts as False and in `timeouts`; the child is then replaced.
    """

    def __init__(self, memory_bytes: int = DEFAULT_MEMORY_BYTES, startup_timeout_s: float = 120.0):
        self.memory_bytes = memory_bytes
        self.startup_timeout_s = startup_timeout_s
        self.timeouts = 0
        self.starts = 0
        self._process: subprocess.Popen | None = None
        self._buffer = b""
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def check(self, requests: list[dict], timeout_s: float, inner_timeout_s: int | None = None) -> list[bool | None]:
        """Requests `{"gold": [...], "pred": [...], "anchored": bool}` -> verdict per request.

        `timeout_s` is the hard deadline of one request. `inner_timeout_s` is math-verify's own alarm (whole
        seconds) for each of its three steps; by default a third of the deadline, so that it usually fires first
        and the worker survives.
        """
        inner = inner_timeout_s or max(1, int(timeout_s // 3))
        with self._lock:
            return [self._check_one(request, timeout_s, inner) for request in requests]

    def close(self) -> None:
        """Kill the child (if any) and wait for it, so that no process is left behind."""
        # Bounded wait for the lock: at interpreter exit a daemon thread may hold it forever; killing the child
        # under it is safe (that thread reads EOF and scores its request 0).
        locked = self._lock.acquire(timeout=5)
        try:
            self._kill()
        finally:
            if locked:
                self._lock.release()

    def _check_one(self, request: dict, timeout_s: float, inner: int) -> bool | None:
        if self._process is None:
            self._start()
        message = json.dumps({**request, "t": inner}) + "\n"
        try:
            self._process.stdin.write(message.encode())
            self._process.stdin.flush()
            reply = self._read_line(time.monotonic() + timeout_s)
        except (BrokenPipeError, EOFError):
            reply = None
        if reply is None:
            self.timeouts += 1
            logger.warning(
                "math-verify worker passed its %.1f s deadline or died; replaced, answer scored 0", timeout_s
            )
            self._kill()
            return False
        return json.loads(reply)["r"]

    def _start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, os.path.abspath(__file__), str(self.memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._buffer = b""
        self.starts += 1
        try:
            reply = self._read_line(time.monotonic() + self.startup_timeout_s)
            timed_out = {"error": f"no answer within {self.startup_timeout_s:.0f} s"}
            status = timed_out if reply is None else json.loads(reply)
        except EOFError:
            status = {"error": f"the process exited with code {self._process.wait()}"}
        if not status.get("ready"):
            self._kill()
            detail = status["error"]
            raise WorkerFailed(f"could not start the math-verify worker: {detail}. Is `math-verify` installed?")

    def _read_line(self, deadline: float) -> bytes | None:
        """One line from the child, None when the deadline passes first; EOFError when the child is gone."""
        # os.read on the raw fd, not readline on a buffered file: select() cannot see Python's buffer.
        fd = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _kill(self) -> None:
        if self._process is None:
            return
        self._process.kill()
        self._process.wait()
        for stream in (self._process.stdin, self._process.stdout):
            stream.close()
        self._process = None


# ---------------------------------------------------------------------------------------------------- child side


def _serve(memory_bytes: int) -> None:
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ValueError, OSError):
        pass  # not supported here (e.g. macOS); the parent's deadline still bounds the time
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the protocol
    logging.basicConfig(level=logging.ERROR)
    try:
        # Import and warm up math-verify before announcing readiness.
        _verdict({"gold": ["$1$"], "pred": ["$1$"], "anchored": False, "t": 1})
    except Exception as error:  # reported to the parent, which raises WorkerFailed with this text
        protocol.write(json.dumps({"error": f"{type(error).__name__}: {error}"}) + "\n")
        return
    protocol.write('{"ready": true}\n')
    for line in sys.stdin.buffer:
        protocol.write(json.dumps({"r": _verdict(json.loads(line))}) + "\n")


def _verdict(request: dict) -> bool | None:
    from math_verify import verify

    timeout = request["t"]
    gold_parsed = _parse_first(tuple(request["gold"]), timeout)
    if not gold_parsed:
        return None
    pred_parsed = _parse_first(tuple(request["pred"]), timeout, anchored=request["anchored"])
    if not pred_parsed:
        return False
    try:
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except BaseException as error:  # math-verify's TimeoutException is a BaseException (0.9.0)
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        return False


_GOLD_CACHE: dict[tuple[str, ...], list] = {}


def _parse_first(candidates: tuple[str, ...], timeout: int, anchored: bool | None = None) -> list:
    """Parse candidates in order until one gives a result. `anchored=None` marks a gold answer (cached)."""
    # The G completions of a group share one gold answer: parse it once.
    cache = anchored is None
    if cache and candidates in _GOLD_CACHE:
        return _GOLD_CACHE[candidates]
    from math_verify import parse

    options = _anchored_options() if anchored else {}
    parsed: list = []
    for text in candidates:
        try:
            parsed = parse(text, parsing_timeout=timeout, **options)
        except BaseException as error:
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            parsed = []
        if parsed:
            break
    if cache:
        if len(_GOLD_CACHE) >= 4096:
            _GOLD_CACHE.clear()
        _GOLD_CACHE[candidates] = parsed
    return parsed


def _anchored_options() -> dict:
    # TRL `accuracy_reward` / open-r1: \boxed first, no anchor-free extraction from the reasoning text.
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    normalization = NormalizationConfig(
        nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True
    )
    latex = LatexExtractionConfig(
        normalization_config=normalization, boxed_match_priority=0, try_extract_without_anchor=False
    )
    return {
        "extraction_config": [latex, ExprExtractionConfig(try_extract_without_anchor=False)],
        "extraction_mode": "first_match",
    }


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
