"""JSON over HTTP for the rewards that ask a server (grpo.rewards.judge, grpo.rewards.remote): one POST with a
timeout and retries, every failure a one-line error naming the URL; and many of them at once, at most `concurrency`
in flight. The standard library only (no client package to install)."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from .runner import RewardUnavailable

RETRIED = (408, 409, 425, 429, 500, 502, 503, 504)  # statuses worth another try (overload, a restart)


def check_url(who: str, key: str, url: str) -> None:
    """A `ValueError` naming the setting unless `url` is an http(s) URL."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{who}: setting {key} must be an http:// or https:// URL of the server, got {url!r}")


def request_json(url: str, body: Any | None, *, timeout_s: float, retries: int, who: str,
                 headers: dict[str, str] | None = None, backoff_s: float = 0.5) -> Any:
    """The JSON reply of a POST of `body` (a GET when None). A server that cannot be reached, does not answer within
    `timeout_s`, or answers 408/429/5xx is tried `retries` more times (waiting backoff_s, 2 backoff_s, ... at most
    8 s); then, or at once for another status or a reply that is not JSON, `RewardUnavailable` names the URL."""
    data = None if body is None else json.dumps(body).encode()
    head = {"Content-Type": "application/json", **(headers or {})}
    problem = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(backoff_s * 2 ** (attempt - 1), 8.0))
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data, head), timeout=timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as err:
            problem = f"answered HTTP {err.code}: {_detail(err)}"
            if err.code in RETRIED:
                continue
            raise RewardUnavailable(f"{who}: {url} {problem}") from None
        except (urllib.error.URLError, OSError) as err:  # (refused, unknown host, reset, timed out)
            reason = getattr(err, "reason", err)
            timed_out = isinstance(reason, TimeoutError) or "timed out" in str(reason)
            problem = f"did not answer within {timeout_s:g} s" if timed_out else f"cannot be reached ({reason})"
            continue
        try:
            return json.loads(raw)
        except ValueError:
            raise RewardUnavailable(f"{who}: {url} replied with a body that is not JSON: {raw[:200]!r}") from None
    raise RewardUnavailable(f"{who}: {url} {problem} ({retries + 1} tr{'ies' if retries else 'y'}); check that the server is running and "
                            "that the URL is right")


def _detail(err: urllib.error.HTTPError) -> str:
    """The server's own message: OpenAI's {"error": {"message"}}, else the body's start."""
    try:
        raw = err.read()
    except OSError:
        return str(err.reason)
    try:
        message = json.loads(raw)["error"]
        return str(message.get("message", message) if isinstance(message, dict) else message)[:300]
    except (ValueError, KeyError, TypeError):
        return raw[:300].decode("utf-8", "replace") or str(err.reason)


def gather(task: Callable[[Any], Any], items: list, concurrency: int) -> list:
    """[task(item) for item in items], at most `concurrency` at once, in order. The first exception is raised, and
    the tasks not yet started are dropped (not awaited: a run's reward deadline is not held up by them)."""
    if len(items) <= 1 or concurrency <= 1:
        return [task(item) for item in items]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(concurrency, len(items)),
                                                 thread_name_prefix="grpo-reward-http")
    try:
        futures = [pool.submit(task, item) for item in items]
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
