"""An OpenAI-compatible endpoint on the policy: `/v1/chat/completions`, `/v1/completions` and `/v1/models`
(non-streaming), served from a rollout engine (`generate(prompt_ids, params, seeds)`, grpo.engines.base) with the
weights it holds, so an agent written for any OpenAI client can be run, recorded and trained (grpo.agents.episodes).

    endpoint = Endpoint(engine, tokenizer, SamplingParams(256, temperature=1.0))
    endpoint.start()                       # 127.0.0.1, a free port
    OpenAI(base_url=endpoint.base_url, api_key="-")             # plain calls: not recorded
    key = endpoint.open_episode(seed=7, budget=512)
    OpenAI(base_url=endpoint.episode_url(key), api_key="-")     # this episode's calls, recorded token-exactly

Chat messages and `tools` go through the tokenizer's chat template; the model's `<tool_call>` blocks come back as
`tool_calls` (grpo.agents.parsing); `logprobs` are the engine's; vLLM's `return_token_ids: true` adds
`prompt_token_ids` and `token_ids`. Requests that arrive within `window_s` of each other are sampled in one engine
call (one call per distinct set of sampling settings); the engine is called from one thread only. A bad request
is answered with OpenAI's error object and status; an engine that raises fails the requests of its call (500), and
the endpoint goes on serving.

Bound to 127.0.0.1 by default; bound to any other address it refuses to start without a `token`, which every
request must then bear (`Authorization: Bearer <token>`, the openai client's `api_key`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hmac
import itertools
import json
import logging
import os
import queue
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from grpo.agents.api import (ApiError, Request, chat_reply, chat_response, check_request, sampling_params,
                             text_response)
from grpo.agents.recording import Call, Episode, normal_message
from grpo.config import ConfigError
from grpo.engines.base import SamplingParams
from grpo.engines.vllm_server import send_json

logger = logging.getLogger(__name__)
LOCAL = ("127.0.0.1", "localhost", "::1")
MAX_BODY = 16 * 2**20
MAX_WAIT_WINDOWS = 40  # a batch waits for late requests at most this many windows after its first
RENDERED = 512  # chat template renderings kept (by messages, tools and generation prompt)
WAKE = object()  # put in a batcher's queue: look again at what the open batch waits for
BUSY_CPU = 0.1  # a window in which the process used more CPU time than this share of it is not quiet
POLL_S = 0.01  # the server's loop looks for `shutdown` this often: at http.server's 0.5 s, closing the endpoint at
# each rollout's end waited up to 0.5 s (the calculator agent's rollouts: 1.23 -> 0.79 s, bench/README.md)
ROUTE = re.compile(r"^(?:/episodes/(?P<key>[A-Za-z0-9_-]+))?/v1/(?P<what>chat/completions|completions|models)/?$")


class _Pending:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, seed: int):
        self.prompt_ids, self.params, self.seed = prompt_ids, params, seed
        self.done = threading.Event()
        self.result = self.error = None


class EngineBatcher:
    """One thread calls the engine. A batch takes requests until `expected()` wait, or until a quiet `window_s`: no
    request arrived, no response was sent (`touch`: its episode is on its way to its next request) and this process
    used under BUSY_CPU of the window's CPU time outside its main thread (its episodes are not building requests or
    reading replies: they wait on a tool, a remote service, or are done); at most MAX_WAIT_WINDOWS windows after its
    first request. One engine call per distinct sampling settings. (CPU time, not only the clock: on a loaded
    machine 64 episodes' requests trickle in over longer than a window while their threads wait for a core, and a
    wall-clock window alone split one turn's requests into two engine calls.)"""

    def __init__(self, engine, window_s: float = 0.05, expected=lambda: 0, context=contextlib.nullcontext,
                 clocks=()):
        # `context()`: entered around each engine call, in this thread (autocast is per thread: the trainer's);
        # `clocks`: more CPU clocks that count as busy (the episodes' worker processes, grpo.agents.processes)
        self.engine, self.window_s, self.expected, self.context = engine, window_s, expected, context
        self.clocks = list(clocks)
        self.queue: queue.Queue = queue.Queue()
        self.engine_calls = 0
        self.last = time.monotonic()  # the last request or response (the quiet window runs from it)
        self.thread = threading.Thread(target=self._serve, name="grpo-endpoint-engine", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams, seed: int):
        """(ids, logprobs or None) of one request, when its engine call returns; raises what it raised."""
        item = _Pending(prompt_ids, params, seed)
        self.queue.put(item)
        item.done.wait()
        if item.error is not None:
            raise item.error
        return item.result

    def touch(self) -> None:
        """A response was sent: an episode is on its way to its next request, so the quiet window starts again."""
        self.last = time.monotonic()

    def wake(self) -> None:
        """An episode ended: the open batch may now hold every running episode's request; look again now (not when
        the quiet window ends, which every turn in which an episode ended would otherwise wait for)."""
        self.last = time.monotonic()
        self.queue.put(WAKE)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=60)

    def _serve(self) -> None:
        while True:
            first = self.queue.get()
            if first is None:
                return
            if first is WAKE:
                continue
            batch = [first]
            self.last, cpu = time.monotonic(), self._busy()
            cap = self.last + MAX_WAIT_WINDOWS * self.window_s
            while len(batch) < max(1, self.expected()):  # (until the running episodes all wait, or a quiet window)
                left = min(self.last + self.window_s, cap) - time.monotonic()
                if left <= 0 and time.monotonic() < cap and self._busy() - cpu > BUSY_CPU * self.window_s:
                    self.last, cpu = time.monotonic(), self._busy()  # (the process is busy: not quiet)
                    continue
                if left <= 0:
                    break
                try:
                    item = self.queue.get(timeout=left)
                except queue.Empty:
                    continue  # (a response sent meanwhile moved the window: look again)
                if item is None:
                    self.queue.put(None)
                    break
                if item is WAKE:
                    continue
                self.last = time.monotonic()
                batch.append(item)
            groups: dict[tuple, list[_Pending]] = {}
            for item in batch:  # (by the settings but max_new_tokens)
                groups.setdefault(dataclasses.astuple(item.params)[1:], []).append(item)
            for items in groups.values():
                self._generate(items[0].params, items)

    def _busy(self) -> float:
        return _busy_clock() + sum(clock() for clock in self.clocks)

    def _generate(self, settings: SamplingParams, items: list[_Pending]) -> None:
        try:
            longest = max(i.params.max_new_tokens for i in items)
            with self.context():
                out = self.engine.generate([i.prompt_ids for i in items],
                                           dataclasses.replace(settings, max_new_tokens=longest),
                                           [i.seed for i in items])
            self.engine_calls += 1
            for k, item in enumerate(items):
                # (each row draws from its own seeded stream: cutting at its max_tokens gives what it would sample)
                ids = list(out.ids[k][:item.params.max_new_tokens])
                logprobs = None if out.logprobs is None else [float(x) for x in out.logprobs[k][:len(ids)]]
                item.result = (ids, logprobs)
        except Exception as err:  # noqa: BLE001 - the requests of this call fail; the endpoint goes on
            logger.exception("endpoint: the engine raised on a batch of %d requests", len(items))
            for item in items:
                item.error = ApiError(500, f"the engine raised {type(err).__name__}: {err}", "server_error")
        finally:
            for item in items:
                item.done.set()


def _busy_clock() -> float:
    """CPU seconds of this process but its main thread's: the episodes' and the endpoint's work, not the trainer's
    update, which runs there meanwhile on the vLLM server path with a lag (its intra-op threads still count)."""
    try:
        return time.process_time() - time.clock_gettime(time.pthread_getcpuclockid(threading.main_thread().ident))
    except (AttributeError, OSError):  # (no per-thread clocks here)
        return time.process_time()


class Endpoint:
    """The server (see the module's docstring). `params`: the default sampling settings; in an episode the run's
    settings are used whatever the request asks (the trainer's log-probs assume them), its max_tokens aside."""

    def __init__(self, engine, tokenizer, params: SamplingParams, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, window_s: float = 0.05, model_name: str = "policy",
                 context=contextlib.nullcontext):
        if host not in LOCAL and not token:
            raise ConfigError(f"endpoint: bound to {host}, every request must bear a token; give token=... (the "
                              "agents' api_key), or bind to 127.0.0.1.")
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.host, self.port, self.token, self.window_s, self.model_name = host, port, token, window_s, model_name
        self.bind_port = port  # (0: a free port at each start)
        self.context = context  # entered around each engine call (the trainer's autocast)
        self.clocks = []  # more CPU clocks the batcher counts as busy (the episodes' worker processes)
        self.eos = tokenizer.eos_token_id
        self.episodes: dict[str, Episode] = {}
        self.waiting = 0  # episodes running (the batcher waits for as many requests, or window_s)
        self.errors = 0  # requests answered with an error
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._rendered: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self.server = self.batcher = None

    @property
    def base_url(self) -> str:
        return f"http://{self._authority()}/v1"

    def episode_url(self, key: str) -> str:
        return f"http://{self._authority()}/episodes/{key}/v1"

    def _authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self) -> "Endpoint":
        if self.server is not None:
            return self
        self.batcher = EngineBatcher(self.engine, self.window_s, lambda: self.waiting, self.context, self.clocks)
        handler = type("Handler", (_Handler,), {"endpoint": self})
        self.server = _Server((self.host, self.bind_port), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, args=(POLL_S,), name="grpo-endpoint", daemon=True).start()
        return self

    def serving(self, engine) -> "Endpoint":
        """A new endpoint with these settings over another engine (a rollout pinned to other weights)."""
        return Endpoint(engine, self.tokenizer, self.params, self.host, self.bind_port, self.token, self.window_s,
                        self.model_name, self.context)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.batcher.close()
            self.server = self.batcher = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def open_episode(self, seed: int, budget: int) -> str:
        """A new episode's key: its calls are recorded (`episode(key)`), seeded from `seed`, within `budget`."""
        with self._lock:
            key = f"e{next(self._keys)}"
            self.episodes[key] = Episode(key, seed, budget)
        return key

    def episode_ended(self) -> None:
        """A running episode ended: one request fewer for a batch to wait for, and the quiet window starts again."""
        with self._lock:
            self.waiting -= 1
        batcher = self.batcher
        if batcher is not None:
            batcher.wake()

    def close_episode(self, key: str) -> Episode:
        """The episode's record; later calls under its key are refused (an agent that overran its deadline)."""
        with self._lock:
            episode = self.episodes.pop(key)
        episode.closed = True
        return episode

    def handle(self, path: str, body: bytes | None, authorization: str | None) -> tuple[int, dict]:
        """(status, JSON object) of one request; never raises."""
        try:
            return 200, self._handle(path, body, authorization)
        except ApiError as err:
            self._count_error()
            logger.warning("endpoint: %d on %s: %s", err.status, path, err.message)
            return err.status, err.body()
        except Exception as err:  # noqa: BLE001 - a request never stops the server or the run
            self._count_error()
            logger.exception("endpoint: a request to %s failed", path)
            return 500, ApiError(500, f"{type(err).__name__}: {err}", "server_error").body()

    def _count_error(self) -> None:
        with self._lock:
            self.errors += 1

    def _handle(self, path: str, body: bytes | None, authorization: str | None) -> dict:
        if self.token is not None and not hmac.compare_digest(authorization or "", f"Bearer {self.token}"):
            raise ApiError(401, "a valid bearer token is required (the client's api_key)", "authentication_error",
                           "invalid_api_key")
        route = ROUTE.match(path.split("?")[0])
        if route is None:
            raise ApiError(404, f"no route {path}; served: /v1/chat/completions, /v1/completions, /v1/models",
                           code="not_found")
        what, key = route["what"], route["key"]
        if what == "models":
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "grpo"}]}
        if body is None:
            raise ApiError(405, f"/v1/{what} takes a POST with a JSON body", code="method_not_allowed")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the request body is not JSON ({err})") from None
        request = check_request(data, chat=what == "chat/completions")
        episode = None
        if key is not None:
            episode = self.episodes.get(key)
            if episode is None or episode.closed:
                raise ApiError(404, f"episode {key} is not open (it ended, or overran its deadline)",
                               code="episode_closed")
        return self.complete(request, episode)

    def complete(self, request: Request, episode: Episode | None) -> dict:
        """Sample one request (recorded in `episode` if given) and build its response."""
        messages = [normal_message(m) for m in request.messages] if request.chat else None
        base, drift = None, False
        if request.chat and episode is not None:
            prompt_ids, base, drift = episode.chat_prompt(messages, request.tools, self.render, self.eos)
        elif request.chat:
            prompt_ids = self.render(messages, request.tools, True)
        elif isinstance(request.prompt, str):
            prompt_ids = self.tokenizer(request.prompt)["input_ids"]
        else:
            prompt_ids = list(request.prompt)
        if episode is None:
            room, params = self.params.max_new_tokens, sampling_params(request, self.params, 1)
            index, seed = None, request.seed if request.seed is not None else int.from_bytes(os.urandom(7), "big")
        else:
            room, params = episode.room(prompt_ids, base), self.params
            index, seed = episode.next_seed()
        if room < 1:
            raise ApiError(400, f"the episode's completion budget ({episode.budget} tokens after its first prompt, "
                                "max_completion_length) is spent", code="context_length_exceeded")
        params = dataclasses.replace(params, max_new_tokens=min(room, request.max_tokens or room))
        ids, logprobs = self.batcher.submit(prompt_ids, params, seed)
        ended = bool(ids) and ids[-1] == self.eos
        text = self.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        if not request.chat:
            out = text_response(request, text, prompt_ids, ids, logprobs, ended, self.tokenizer)
            reply, calls = None, 0
        else:
            reply, calls = chat_reply(text)
            out = chat_response(request, reply, prompt_ids, ids, logprobs, ended, self.tokenizer)
        if episode is not None:
            episode.add(Call(index, list(prompt_ids), ids, logprobs, ended, messages, request.tools,
                             normal_message(reply) if reply else None, base, drift, calls))
        return out

    def render(self, messages: list[dict], tools, generation_prompt: bool) -> list[int]:
        """The chat template's token ids of a conversation (with the tools' schemas). The last RENDERED renderings are
        kept (the G episodes of a prompt send the same first request; the template is ~half a request's cost)."""
        key = json.dumps([messages, tools, generation_prompt])
        with self._lock:
            ids = self._rendered.get(key)
            if ids is not None:
                self._rendered.move_to_end(key)
                return list(ids)
        ids = self._render(messages, tools, generation_prompt)
        with self._lock:
            self._rendered[key] = ids
            if len(self._rendered) > RENDERED:
                self._rendered.popitem(last=False)
        return list(ids)

    def _render(self, messages: list[dict], tools, generation_prompt: bool) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as err:  # noqa: BLE001 - the template's own errors (jinja, raise_exception)
            raise ApiError(400, f"messages: the chat template cannot render them ({type(err).__name__}: {err})",
                           param="messages") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # (the default, 5, refuses connections when many episodes call at once)


class _Handler(BaseHTTPRequestHandler):
    endpoint: Endpoint
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # (grpo.engines.vllm_server.send_json)

    def do_GET(self):  # noqa: N802 - http.server's name
        self._answer(*self.endpoint.handle(self.path, None, self.headers.get("Authorization")))

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            self._answer(413, ApiError(413, f"the request body is over {MAX_BODY} bytes").body())
            return
        body = self.rfile.read(length)
        self._answer(*self.endpoint.handle(self.path, body, self.headers.get("Authorization")))

    def _answer(self, status: int, obj: dict) -> None:
        send_json(self, status, obj)
        batcher = self.endpoint.batcher
        if batcher is not None:
            batcher.touch()

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        logger.debug("endpoint: " + format, *args)
