"""Calling reward functions with a deadline, as grpo.rewards.runner's docstring describes: a sync function in the
calling thread (on the main thread, interrupted by a real-time signal of its own when the deadline passes;
elsewhere on a daemon thread, abandoned if it overruns), async functions awaited together, each cancelled at its
deadline. A function gets only the keyword arguments it declares unless it takes **kwargs (TRL passes everything)."""

import asyncio
import concurrent.futures
import inspect
import signal
import threading
from collections.abc import Callable
from typing import Any


class RewardTimeout(Exception):
    """A reward function call overran `timeout_s`."""


def call_all(funcs: list[Callable], batch: dict, timeout_s: float | None = None) -> list[Any]:
    """Call each function; await the async ones together. An exception is returned in place of the result."""
    results: list[Any] = []
    for func in funcs:
        try:
            results.append(_call(func, _arguments(func, batch), timeout_s))
        except Exception as error:
            results.append(error)
    pending = [i for i, result in enumerate(results) if inspect.isawaitable(result)]
    if pending:
        awaitables = [_deadline(results[i], timeout_s) for i in pending]
        for i, value in zip(pending, _run_awaitables(awaitables)):
            results[i] = RewardTimeout() if isinstance(value, asyncio.TimeoutError) else value
    return results


class _Overrun(BaseException):
    """Raised inside a reward function by the timeout signal (BaseException: `except Exception` does not catch it)."""


_ARMED = threading.Event()  # set while a call on the main thread may be interrupted


def _on_timeout_signal(signum, frame) -> None:
    if _ARMED.is_set():
        _ARMED.clear()
        raise _Overrun()


def _timeout_signal() -> int | None:
    """The signal the watchdog sends the main thread: a real-time one nobody else uses (SIGALRM is math-verify's),
    installed once with a handler that does nothing unless a call is armed. None where signals cannot be used."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_kill"):
        return None
    number = getattr(signal, "SIGRTMIN", None)
    number = number + 3 if number is not None else signal.SIGUSR2
    current = signal.getsignal(number)
    if current is _on_timeout_signal:
        return number
    if current not in (signal.SIG_DFL, None):
        return None  # someone else's handler: leave it, and use a thread
    signal.signal(number, _on_timeout_signal)
    return number


def _call(func: Callable, kwargs: dict, timeout_s: float | None) -> Any:
    """func(**kwargs) with a deadline (an async function returns its coroutine): on the main thread, interrupted by
    a signal; elsewhere, run on a daemon thread that is abandoned when it overruns."""
    if timeout_s is None or inspect.iscoroutinefunction(func):
        return func(**kwargs)
    number = _timeout_signal()
    if number is None:
        return _call_on_thread(func, kwargs, timeout_s)
    main = threading.main_thread().ident
    timer = threading.Timer(timeout_s, lambda: _ARMED.is_set() and signal.pthread_kill(main, number))
    timer.daemon = True
    _ARMED.set()
    timer.start()
    try:
        return func(**kwargs)
    except _Overrun:
        raise RewardTimeout() from None
    finally:
        _ARMED.clear()  # first: a signal that arrives from here on does nothing
        timer.cancel()
        timer.join()


def _call_on_thread(func: Callable, kwargs: dict, timeout_s: float) -> Any:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = func(**kwargs)
        except BaseException as error:  # noqa: BLE001 - handed back to the caller's thread below
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True, name="grpo-reward")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout()
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _deadline(awaitable, timeout_s: float | None):
    return await (awaitable if timeout_s is None else asyncio.wait_for(awaitable, timeout_s))


def _arguments(func: Callable, batch: dict) -> dict:
    # TRL passes everything; a function without **kwargs gets only the names it declares instead of a TypeError.
    signature = signature_of(func)
    if signature is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return batch
    return {key: value for key, value in batch.items() if key in signature.parameters}


def _run_awaitables(awaitables: list) -> list:
    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    # Called from inside a running loop (a notebook): run ours on a thread of its own.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def signature_of(func: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None
