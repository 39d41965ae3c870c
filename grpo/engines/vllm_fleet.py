"""Several `grpo vllm-serve` servers as one rollout engine (`vllm_server_base_url` naming several): the layout of a
cluster whose generation nodes each run a server.

- **Rows.** Each request's rows are spread over the servers that are up (`spread`): the G rows of one prompt stay
  together (the server's prefix cache shares their prompt), and prompts go longest first to the server with the
  least work so far, a row weighing its prompt's tokens plus the completion budget. Each server answers its rows
  in one request, all servers at once; the completions come back in the rows' order. With per-row seeds
  (`vllm_per_row_seeds`, on by default on the CPU) a row's completion depends on its prompt, seed and weights
  only, so 1 and N servers give the same run.
- **Weights.** Every push goes to every server: over one two-rank process group per server (port
  `vllm_group_port` + i), each bucket packed once and broadcast on every group side by side
  (grpo.engines.vllm_weights.fan_out), or as one streamed POST per server, the body's chunks written to each.
- **Failures.** A server that stops answering (a connection refused or reset, a push that fails) is taken out: a
  line names it, its rows go to the others (the rows keep their seeds, so the run does not change), and
  `fleet/servers_up` counts those left. When none is left the request raises `ServersDown`, and the trainer
  writes a checkpoint of its last step and stops with exit status 75 (grpo.training.run.signals), as on a signal.
- **Several trainer processes** send one request a step from the main process (`generate_together`), or, on the
  lag path, every process sends its part of each server's rows under the rollout's key, an empty part included, so
  that each server runs its rows of every process as one engine call (the server's `Together`).
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import torch

from grpo.engines import vllm_weights
from grpo.engines.base import Completions, EngineDefaults, ReturnsRoutes, SamplingParams
from grpo.engines.vllm_server import (ServersDown, VLLMServerClient, generate_together, push_tag,
                                      update_weights)


def spread(prompt_ids: list[list[int]], servers: int, max_new_tokens: int) -> list[list[int]]:
    """The rows each of `servers` servers gets, each list in the rows' order. Runs of one prompt (a group's G rows)
    go together, heaviest first to the server with the least weight so far (ties: the lower index), a row weighing
    its prompt's length plus `max_new_tokens`; the same rows always give the same spread."""
    runs, start = [], 0
    for i in range(1, len(prompt_ids) + 1):
        if i == len(prompt_ids) or prompt_ids[i] != prompt_ids[start]:
            runs.append(range(start, i))
            start = i
    weight = [len(r) * (len(prompt_ids[r[0]]) + max_new_tokens) for r in runs]
    loads, parts = [0] * servers, [[] for _ in range(servers)]
    for run in sorted(range(len(runs)), key=lambda j: (-weight[j], j)):
        least = min(range(servers), key=lambda s: (loads[s], s))
        parts[least].extend(runs[run])
        loads[least] += weight[run]
    return [sorted(part) for part in parts]


class VLLMFleet(EngineDefaults, ReturnsRoutes):
    """The rollout engine of a trainer process in server mode, over the servers at `urls` (one or more): the
    members are `VLLMServerClient`s (their arguments as there; member i's weight group on `group_port` + i)."""

    def __init__(self, urls: list[str], eos_ids: list[int], timeout: float = 240.0, push: bool = True,
                 barrier=None, *, transport: str = "collective", group_port: int = 51216, device=None,
                 per_row_seeds: bool | None = None, rank: int = 0, processes: int = 1, gather=None, share=None):
        self.push, self.barrier, self.transport = push, barrier, transport
        self.rank, self.processes, self.gather, self.share = rank, processes, gather, share
        self.members: list[VLLMServerClient] = []
        for i, url in enumerate(urls):
            try:
                self.members.append(VLLMServerClient(url, eos_ids, timeout, push, transport=transport,
                                                     group_port=group_port + i, device=device,
                                                     per_row_seeds=per_row_seeds, rank=rank, processes=processes))
            except ConnectionError as err:
                self.close()
                raise (ConnectionError(f"server {i + 1} of {len(urls)}: {err}") if len(urls) > 1 else err) from None
        dtypes = {m.url: m.info.get("dtype") for m in self.members}
        if len(set(dtypes.values())) > 1:
            self.close()
            raise ConnectionError(f"the servers run different dtypes ({dtypes}); start every `grpo vllm-serve` "
                                  f"with the same --dtype")
        self.up = list(self.members)
        self.url = ", ".join(m.url for m in self.members)
        self.per_row_seeds = self.members[0].per_row_seeds
        # (an MoE's routes come back when every server records the same layers)
        layers = {m.route_layers for m in self.members}
        self.route_layers = layers.pop() if len(layers) == 1 else None
        self.routes_missing = next((f"{m.url}: {m.routes_missing}" for m in self.members if m.route_layers is None),
                                   "the servers record different numbers of MoE layers")
        # (what a push sends: the engines' dtype, from the device of the collective groups; None: http)
        self.dtype, self.device = self.members[0].dtype, getattr(self.members[0], "device", None)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(len(self.members), thread_name_prefix="grpo-fleet")
        # Pushes have threads of their own: a queued push waits at a server until a request loads the push staged
        # before it, and that request must not wait behind the push for a thread (with a lag of 2 it did, for ever).
        self.push_pool = ThreadPoolExecutor(len(self.members), thread_name_prefix="grpo-fleet-push")

    @property
    def servers_up(self) -> int:
        return len(self.up)

    def close(self) -> None:
        for member in self.members:
            member.close()

    def _down(self, member: VLLMServerClient, err: BaseException, what: str) -> None:
        """Take `member` out of the fleet (once), with a line naming it."""
        with self.lock:
            if member not in self.up:
                return
            self.up.remove(member)
            left = len(self.up)
        member.close()
        print(f"grpo: vLLM server {member.url} failed in {what} ({type(err).__name__}: {err}); "
              f"{left} of {len(self.members)} server(s) left" + (", which take its rows" if left else ""),
              file=sys.stderr, flush=True)

    def _live(self, what: str) -> list[VLLMServerClient]:
        with self.lock:
            up = list(self.up)
        if not up:
            raise ServersDown(f"every vLLM server stopped answering ({', '.join(m.url for m in self.members)}) "
                              f"in {what}; restart them (`grpo vllm-serve`), then resume the run")
        return up

    def wait_for_step(self, step: int, poll_s: float = 0.02) -> None:
        """Return once every server up holds or has staged the weights of `step` (`/health`): a trainer process
        that does not push, before its first request naming `step`, while the main process's push thread may still
        be sending them. A server that does not answer is left to that request (which takes it out)."""
        deadline = time.monotonic() + self.members[0].timeout
        for member in self._live("the wait for a push"):
            while time.monotonic() < deadline:
                try:
                    health = member._call("/health")
                except OSError:
                    break
                if step in (health["policy_step"], health["staged_step"]):
                    break
                time.sleep(poll_s)
            else:
                raise TimeoutError(f"vLLM server {member.url}: the weights of step {step} did not arrive within "
                                   f"{self.members[0].timeout:g} s (vllm_server_timeout)")

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> Completions:
        return self.generate_at(prompt_ids, params, seeds)[0]

    def generate_together(self, prompt_ids, params, seeds) -> Completions:
        """Every process's rows in one request from the main process; every process must call it at once."""
        return generate_together(self, prompt_ids, params, seeds)

    def generate_at(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int],
                    step: int | None = None, together: str | None = None) -> tuple[Completions, int | None]:
        """`VLLMServerClient.generate_at` over the fleet: the rows spread over the servers up, the rows of a server
        that fails sent again to the others (under a new `together` key: every process does the same)."""
        n = len(prompt_ids)
        ids, truncated, logprobs, routes = [None] * n, [None] * n, [None] * n, [None] * n
        todo, served, attempt = list(range(n)), None, 0
        while todo or attempt == 0:  # (a request of no rows still goes, as empty parts, when it names a step or key)
            up = self._live("generation")
            parts = spread([prompt_ids[i] for i in todo], len(up), params.max_new_tokens)
            key = together if together is None or attempt == 0 else f"{together} (again, {attempt})"
            jobs = [(member, [todo[j] for j in part]) for member, part in zip(up, parts)]
            # An empty part goes too when other processes send theirs under the key (the server's Together waits
            # for every part), and when the request names a step: it loads a push staged for that step, which a
            # server given no rows would otherwise hold, and the next push would wait behind it for ever.
            if step is None and (key is None or self.processes == 1):
                jobs = [(member, rows) for member, rows in jobs if rows]
            futures = [self.pool.submit(member.generate_at, [prompt_ids[i] for i in rows], params,
                                        [seeds[i] for i in rows], step, key) for member, rows in jobs]
            todo, attempt = [], attempt + 1
            for (member, rows), future in zip(jobs, futures):
                try:
                    out, served = future.result()
                except OSError as err:  # (refused, reset, closed: the server is gone; an answered error raises)
                    self._down(member, err, "generation")
                    todo.extend(rows)
                    continue
                for k, i in enumerate(rows):
                    ids[i], truncated[i] = out.ids[k], out.truncated[k]
                    logprobs[i] = None if out.logprobs is None else out.logprobs[k]
                    routes[i] = None if out.routes is None else out.routes[k]
            todo.sort()
        has_logprobs = n > 0 and all(lp is not None for lp in logprobs)
        has_routes = n > 0 and all(r is not None for r in routes)
        return Completions(ids, truncated, logprobs if has_logprobs else None, routes if has_routes else None), served

    def update_weights(self, model, step: int | None = None, queued: bool = False) -> None:
        """Push the policy's weights to every server (`step`, `queued`: as VLLMServerClient's)."""
        update_weights(self, model, step, queued)

    def push_weights(self, weights, step: int | None = None, queued: bool = False) -> dict:
        """Send (name, tensor) pairs to every server up, each bucket once; a server that fails is taken out.
        Returns {"weights_version": each server's count, in the order of those up}."""
        up = self._live("the weight push")
        tag = push_tag(step, queued)
        if self.transport == "collective":
            if queued:  # (each server's staged push loaded before the broadcasts: VLLMServerClient.push_weights)
                for member, ready in [(m, self.push_pool.submit(m._call, "/wait_unstaged", b"")) for m in up]:
                    try:
                        ready.result()
                    except OSError as err:
                        self._down(member, err, "the weight push")
                up = self._live("the weight push")
            replies = [self.push_pool.submit(m._call, f"/update_weights?transport=collective{tag}", b"") for m in up]
            _, failed = vllm_weights.fan_out([m.group for m in up], weights, up[0].device, up[0].dtype)
            errors = dict(failed)
            for i, reply in enumerate(replies):
                try:
                    replies[i] = reply.result()
                except OSError as err:  # (gone; an answered error raises)
                    errors.setdefault(i, err)
        else:
            replies, errors = _http_push(up, weights, up[0].dtype, tag)
        for i, err in sorted(errors.items()):
            self._down(up[i], err, "the weight push")
        self._live("the weight push")
        return {"weights_version": [r["weights_version"] for i, r in enumerate(replies) if i not in errors]}


def _http_push(up: list[VLLMServerClient], weights, dtype: torch.dtype | None, tag: str
               ) -> tuple[list, dict[int, BaseException]]:
    """One chunked POST /update_weights per server, the body's chunks made once and written to each connection in
    turn (each server reads its stream as it arrives). The replies by server, and the failures by index."""
    connections, errors, replies = {}, {}, [None] * len(up)
    for i, member in enumerate(up):
        where = urllib.parse.urlsplit(member.url)
        connection = http.client.HTTPConnection(where.hostname, where.port or 80)
        try:
            connection.putrequest("POST", f"/update_weights?transport=http{tag}")
            connection.putheader("Content-Type", "application/octet-stream")
            connection.putheader("Transfer-Encoding", "chunked")
            connection.endheaders()
            connections[i] = connection
        except OSError as err:
            errors[i] = err
    for chunk in vllm_weights.http_body(weights, dtype):
        for i, connection in list(connections.items()):
            try:
                connection.send(b"%X\r\n" % len(chunk))
                connection.send(chunk)
                connection.send(b"\r\n")
            except OSError as err:
                errors[i] = err
                connections.pop(i).close()
    for i, connection in connections.items():
        try:
            connection.send(b"0\r\n\r\n")
            response = connection.getresponse()
            replies[i] = json.loads(response.read() or b"{}")
            if response.status != 200:
                raise RuntimeError(f"vLLM server {up[i].url}/update_weights: "
                                   f"{replies[i].get('error', response.reason)}")
        except OSError as err:
            errors[i] = err
        finally:
            connection.close()
    return replies, errors
