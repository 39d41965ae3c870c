"""vLLM as a server (`vllm_mode: server`): `grpo vllm-serve` runs one engine that any number of trainer processes,
on this machine or another, send prompts to; the main trainer process pushes the policy's weights into it after each
optimizer step.

The protocol is HTTP endpoints with JSON bodies (typed records on both sides: grpo.engines.vllm_protocol), served by
the standard library, so a trainer needs neither vLLM nor a web framework to talk to it:

    GET  /health              {"model", "weights_version", "policy_step", "staged_step", "device", "device_uuid",
                              "dtype", "routes" (an MoE's layers the engine records routes of, or null),
                              "routes_missing" (why not)}
    POST /generate            {"prompt_ids", "params" (SamplingParams' fields), "seeds" (or null), "eos_ids",
                              "step", "together", "routes" (optional)} -> {"ids", "truncated", "logprobs",
                              "policy_step", "routes" and "route_shape" when asked (grpo.engines.vllm_protocol)}
    POST /init_communicator   {"host", "port", "backend"}: join the trainer in a two-rank process group
                              (grpo.engines.vllm_weights)
    POST /update_weights      ?transport=collective: receive the weights over that group, bucket by bucket;
                              ?transport=http: a chunked body of the same buckets -> {"weights_version": n}
                              &step=s: the trainer's optimizer steps behind these weights (policy_step)
                              &queued=1: held until a request names step s (grpo.engines.vllm_pushes)
    POST /wait_unstaged       answers once no queued push is staged (before a queued collective push)

`weights_version` counts the pushes; `policy_step` is the step the trainer named with the push the engine holds
(null when it named none), `staged_step` that of a queued push not loaded yet. A generate request that names a
`step` is refused unless the server holds exactly those weights or has them staged (then loads them first): with
max_staleness the trainer asks for rollout t with the weights of step t - k, and this check makes a push that
overtook its requests an error instead of a silently different run (grpo.training.rollout.pipeline_server).

Requests run one at a time on the engine (vLLM's `LLM` is not thread-safe). In training the main process sends one
generate request a step with every process's rows and hands each process its own completions back
(`generate_together`), so the server batches the whole step as a colocated engine would; each row keeps its own
seed when seeds are sent (`vllm_per_row_seeds`), so completions do not depend on how rows were split.
"""

from __future__ import annotations

import atexit
import dataclasses
import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from grpo.engines import vllm_weights
from grpo.engines.base import Completions, EngineDefaults, ReturnsRoutes, SamplingParams
from grpo.engines.vllm_protocol import CommunicatorRequest, GenerateReply, GenerateRequest, Part
from grpo.engines.vllm_pushes import PushQueue


@dataclasses.dataclass
class Served:
    """What the server's request handlers share: the engine, the lock that runs one request on it at a time, the
    state /health reports, and the weight-transfer process group once a trainer has opened one."""

    model: str
    engine: object
    device: torch.device
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    state: dict = dataclasses.field(default_factory=dict)
    group: tuple | None = None  # (process group, the device it receives on)
    together: Together = dataclasses.field(default_factory=lambda: Together())
    pushes: PushQueue = dataclasses.field(default_factory=PushQueue)  # (a lagged trainer's: vllm_pushes)

    def __post_init__(self):
        self.state.setdefault("staged_step", None)


class Refused(ValueError):
    """A generate request for weights the server does not hold (HTTP 409)."""


class ServersDown(RuntimeError):
    """Every server the trainer generates with stopped answering (grpo.engines.vllm_fleet): the run writes a
    checkpoint of its last step and stops with exit status 75, to be resumed once a server is back."""


def generate(served: Served, request: GenerateRequest) -> GenerateReply:
    """Run one /generate request on the engine (one request at a time); its reply."""
    with served.lock:
        served.pushes.apply_for(served.engine, served.state, request.step)  # (a staged push it names)
        held = served.state["policy_step"]
        if request.step is not None and request.step != held:
            raise Refused(f"the request names the weights of step {request.step}, the server holds those of step "
                          f"{held}")
        if request.routes and served.engine.route_layers is None:
            raise ValueError(f"the request asks for routes, which this server does not record "
                             f"({served.engine.routes_missing})")
        if not request.prompt_ids:  # (a fleet's part with no rows: every process sends one to every server)
            return GenerateReply(Completions([], [], [], [] if request.routes else None), held)
        served.engine.eos_ids = list(request.eos_ids)
        served.engine.per_row_seeds = request.seeds is not None
        out = served.engine.generate(request.prompt_ids, request.params,
                                     request.seeds or [0] * len(request.prompt_ids))
    return GenerateReply(out if request.routes else dataclasses.replace(out, routes=None), held)


class Together:
    """The parts of one rollout's request that several trainer processes send separately (the lag path's request
    threads, which cannot gather their rows over the process group while the update's collectives run on it), run
    as one engine call when the last part arrives, as `generate_together` does on the synchronous path (each
    request's `together` Part: its rollout, how many processes send, which one this is, how long to wait)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.open: dict[str, dict] = {}  # key -> {"requests": {part: request}, "reply": None, "taken": n}

    def join(self, request: GenerateRequest, run) -> GenerateReply:
        spec = request.together
        key, parts, part = spec.key, spec.parts, spec.part
        with self.cond:
            entry = self.open.setdefault(key, {"requests": {}, "reply": None, "taken": 0})
            entry["requests"][part] = request
            last = len(entry["requests"]) == parts
        if last:
            requests = [entry["requests"][i] for i in range(parts)]
            try:
                reply = run(GenerateRequest.merged(requests)).split([len(r.prompt_ids) for r in requests])
            except Exception as err:  # noqa: BLE001 - every part gets the reason
                reply = err
            with self.cond:
                entry["reply"] = reply
                self.cond.notify_all()
        with self.cond:
            if not self.cond.wait_for(lambda: entry["reply"] is not None, timeout=spec.timeout):
                self.open.pop(key, None)
                raise TimeoutError(f"request {key}: {len(entry['requests'])} of {parts} trainer processes sent "
                                   f"their rows within {spec.timeout} s (vllm_server_timeout)")
            entry["taken"] += 1
            if entry["taken"] == parts:
                self.open.pop(key, None)
        if isinstance(entry["reply"], Exception):
            raise entry["reply"]
        return entry["reply"][part]


def serve(model: str, host: str = "0.0.0.0", port: int = 8000, **engine_kwargs) -> None:
    """Run a vLLM engine for `model` behind the HTTP endpoints above until interrupted."""
    from grpo.engines.vllm import VLLMEngine

    engine = VLLMEngine(model, eos_ids=[], **engine_kwargs)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = str(engine.llm.llm_engine.model_config.dtype).removeprefix("torch.")
    server = ThreadingHTTPServer((host, port), Handler)
    server.served = Served(model, engine, device, state={
        "weights_version": 0, "policy_step": None, "device": device.type,
        "device_uuid": vllm_weights.device_uuid(device), "dtype": dtype, "routes": engine.route_layers,
        "routes_missing": engine.routes_missing})
    print(f"grpo vllm-serve: {model} on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def send_json(handler: BaseHTTPRequestHandler, status: int, body: dict) -> None:
    """An HTTP handler's JSON reply: status, headers with the length, the body.

    The handler must set `disable_nagle_algorithm` (TCP_NODELAY): http.server writes the headers and the body
    apart, and on a kept-alive connection Nagle's algorithm held the body until the client's delayed ACK of the
    headers, 40 ms a reply on Linux (an agent's openai client: 44 ms a call against 2 ms)."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class Handler(BaseHTTPRequestHandler):
    """The endpoints of the module docstring, on the server's `served` engine."""

    protocol_version = "HTTP/1.1"  # (chunked request bodies)
    disable_nagle_algorithm = True  # (see send_json)

    def _reply(self, body: dict, status: int = 200) -> None:
        send_json(self, status, body)

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path != "/health":
            return self._reply({"error": f"no endpoint {self.path}"}, 404)
        self._reply({"model": self.server.served.model, **self.server.served.state})

    def do_POST(self):  # noqa: N802
        served, (path, _, query) = self.server.served, self.path.partition("?")
        try:
            if path == "/update_weights":
                options = urllib.parse.parse_qs(query)
                step = options.get("step", [None])[0]
                return self._reply(self._update_weights(options.get("transport", [""])[0],
                                                        None if step is None else int(step),
                                                        options.get("queued", ["0"])[0] == "1"))
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if path == "/generate":
                request = GenerateRequest.from_json(body)
                if request.together is not None:  # (one part of a request several trainer processes send)
                    return self._reply(served.together.join(request, lambda whole: generate(served, whole)).to_dict())
                return self._reply(generate(served, request).to_dict())
            if path == "/wait_unstaged":  # (before a queued collective push: grpo.engines.vllm_pushes)
                served.pushes.wait_free()
                return self._reply({"ok": True})
            if path == "/init_communicator":
                # (blocks until the trainer joins: the trainer sends this from a thread of its own). An earlier
                # trainer's group, if any, is shut down.
                if served.group is not None:
                    vllm_weights.close_group(served.group[0])
                    served.group = None
                join = CommunicatorRequest.from_json(body)
                group = vllm_weights.open_group(join.host, join.port, 1, join.backend, join.timeout)
                served.group = group, served.device if join.backend == "nccl" else torch.device("cpu")
                return self._reply({"ok": True})
            self._reply({"error": f"no endpoint {self.path}"}, 404)
        except Refused as err:
            self._reply({"error": str(err)}, 409)
        except Exception as err:  # noqa: BLE001 - the trainer gets the reason, the server stays up
            self.close_connection = True
            self._reply({"error": f"{type(err).__name__}: {err}"}, 500)

    def _update_weights(self, transport: str, step: int | None, queued: bool) -> dict:
        served = self.server.served
        if transport == "collective":
            if served.group is None:
                raise RuntimeError("no weight-transfer group: POST /init_communicator first")
            # (a queued push is held in host memory, one bucket copied off the device at a time)
            weights = vllm_weights.receive_weights(*served.group, to_host=queued)
        elif transport == "http":
            reader = vllm_weights.ChunkedReader(self.rfile)
            weights = vllm_weights.read_http_weights(reader)
        else:
            raise ValueError(f"transport {transport!r}: use collective or http")
        if queued:  # (loaded by the first request that names `step`: grpo.engines.vllm_pushes)
            served.pushes.stage(weights, step, served.state)
        else:
            with served.lock:
                served.pushes.drop(served.state)
                served.engine.load_weights(weights)  # (one reload_weights, reading the stream as it goes)
                served.state["weights_version"] += 1
                served.state["policy_step"] = step
        if transport == "http":
            reader.finish()
        return {"weights_version": served.state["weights_version"]}

    def log_message(self, *args) -> None:  # one line per request would drown the engine's own log
        pass


class VLLMServerClient(EngineDefaults, ReturnsRoutes):
    """The rollout engine of a trainer process in server mode.

    `generate` asks the server for this process's rows; `generate_together`, called by every process at once
    (`gather` and `share` are the process group's object gather and broadcast from the main process), sends one
    request with all of them from the main process and hands each process its own completions. `update_weights`
    pushes the policy's weights when this process is the one that pushes (`push`), over `transport` ("collective":
    a process group on `group_port`, NCCL between CUDA devices and gloo otherwise; "http": a streamed POST), then
    waits at `barrier` so that no process generates from the old weights. `per_row_seeds` (None: on when the
    server runs on the CPU) sends each row's seed. Waits up to `timeout` seconds for the server to answer at
    first. `rank` of `processes`: this process among the trainer's (`generate_at`'s parts)."""

    def __init__(self, base_url: str, eos_ids: list[int], timeout: float = 240.0, push: bool = True,
                 barrier=None, *, transport: str = "collective", group_port: int = 51216, device=None,
                 per_row_seeds: bool | None = None, rank: int = 0, processes: int = 1, gather=None, share=None):
        self.url, self.eos_ids, self.push, self.barrier = base_url.rstrip("/"), list(eos_ids), push, barrier
        self.rank, self.processes, self.gather, self.share, self.timeout = rank, processes, gather, share, timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.info = self._call("/health")
                break
            except OSError as err:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no vLLM server answered at {self.url} within {timeout:g} s ({err}); "
                                          f"start one with `grpo vllm-serve --model PATH`, or check "
                                          f"vllm_server_base_url / vllm_server_host / vllm_server_port") from None
                time.sleep(1.0)
        self.per_row_seeds = self.info["device"] == "cpu" if per_row_seeds is None else per_row_seeds
        self.dtype = vllm_weights.DTYPES.get(self.info.get("dtype"))  # weights travel in the engine's dtype
        # (an MoE's routes: the layers the server records, asked for with every request; None: it records none)
        self.route_layers = self.info.get("routes")
        self.routes_missing = self.info.get("routes_missing") or "the server's grpo version returns no routes"
        self.transport, self.group = transport, None
        if push and transport == "collective":
            self.group, self.device = self._open_group(group_port, torch.device(device or "cpu"))
            atexit.register(self.close)  # (as TRL's client closes its communicator)

    def close(self) -> None:
        """Shut this process's side of the weight-transfer group down (at exit, or when done with the server)."""
        if self.group is not None:
            vllm_weights.close_group(self.group)
            self.group = None

    def _open_group(self, port: int, device: torch.device):
        """Open a two-rank group with the server, this process hosting its store on `port` at the address the
        server is reached from (as TRL's client does)."""
        backend = "nccl" if device.type == "cuda" and self.info["device"] == "cuda" else "gloo"
        device = device if backend == "nccl" else torch.device("cpu")
        if backend == "nccl" and vllm_weights.device_uuid(device) == self.info.get("device_uuid"):
            # NCCL does not run two ranks of one group on one device: the first broadcast would fail or hang, with
            # the server stuck receiving (TRL's vllm-serve refuses the same way).
            raise ConnectionError(f"the trainer's {device} and the server at {self.url} are the same GPU (UUID "
                                  f"{self.info['device_uuid']}), and NCCL cannot push weights within one GPU; run "
                                  f"`grpo vllm-serve` on another GPU (CUDA_VISIBLE_DEVICES), or set "
                                  f"vllm_weight_transfer: http")
        server = urllib.parse.urlsplit(self.url)
        host = vllm_weights.address_towards(server.hostname, server.port or 80)
        try:
            with ThreadPoolExecutor(1) as pool:  # (the server's reply waits for both ranks to join)
                reply = pool.submit(self._call, "/init_communicator", json.dumps(dataclasses.asdict(
                    CommunicatorRequest(host, port, backend, self.timeout))).encode())
                group = vllm_weights.open_group(host, port, 0, backend, self.timeout)
                reply.result()
        except (RuntimeError, OSError) as err:  # (torch's store and group errors are RuntimeErrors)
            raise ConnectionError(f"vllm_group_port: the server did not join this process's weight-transfer group "
                                  f"at {host}:{port} ({err}); let the server reach that port, or set "
                                  f"vllm_weight_transfer: http") from None
        return group, device

    def _call(self, path: str, body: bytes | None = None, content_type: str = "application/json") -> dict:
        request = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            reason = json.loads(err.read() or b"{}").get("error", err.reason)
            raise RuntimeError(f"vLLM server {self.url}{path}: {reason}") from None

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> Completions:
        return self.generate_at(prompt_ids, params, seeds)[0]

    def generate_at(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int],
                    step: int | None = None, together: str | None = None) -> tuple[Completions, int | None]:
        """The rows' completions, and the step of the weights the server sampled them with (as it reports it);
        with `step`, only from the weights pushed with that step (the server refuses the request otherwise).
        `together`: a key every process sends its part of one rollout's request under, at about the same time;
        the server runs the parts as one request (its `Together`)."""
        part = Part(together, self.processes, self.rank, self.timeout) if together and self.processes > 1 else None
        request = GenerateRequest(prompt_ids, params, list(seeds) if self.per_row_seeds else None, self.eos_ids,
                                  step, part, self.route_layers is not None)
        reply = GenerateReply.from_json(self._call("/generate", json.dumps(request.to_dict()).encode()))
        return reply.completions, reply.policy_step

    def generate_together(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]
                          ) -> Completions:
        """`generate` for every process's rows in one request; every process must call it at the same time."""
        return generate_together(self, prompt_ids, params, seeds)

    def update_weights(self, model, step: int | None = None, queued: bool = False) -> None:
        """Push the policy's weights (`step`: the optimizer steps behind them, which the server then reports;
        `queued`: the server loads them when a request names `step`, grpo.engines.vllm_pushes)."""
        update_weights(self, model, step, queued)

    def push_weights(self, weights, step: int | None = None, queued: bool = False) -> dict:
        """Send (name, tensor) pairs to the server, one bucket at a time; returns the server's reply."""
        tag = push_tag(step, queued)
        if self.transport == "collective":
            if queued:  # (the broadcast starts once the server can take it: its wait has no timeout, a group's has)
                self._call("/wait_unstaged", b"")
            with ThreadPoolExecutor(1) as pool:  # (the server's reply waits for the whole stream)
                reply = pool.submit(self._call, f"/update_weights?transport=collective{tag}", b"")
                vllm_weights.send_weights(self.group, weights, self.device, self.dtype)
                return reply.result()
        host = urllib.parse.urlsplit(self.url)
        connection = http.client.HTTPConnection(host.hostname, host.port or 80)
        try:
            connection.request("POST", f"/update_weights?transport=http{tag}", body=vllm_weights.http_body(weights,
                               self.dtype), headers={"Content-Type": "application/octet-stream"}, encode_chunked=True)
            response = connection.getresponse()
            reply = json.loads(response.read() or b"{}")
        finally:
            connection.close()
        if response.status != 200:
            raise RuntimeError(f"vLLM server {self.url}/update_weights: {reply.get('error', response.reason)}")
        return reply


def generate_together(client, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int]) -> Completions:
    """`client.generate` of every process's rows in one request from the main process, each process handed its own
    completions (`client.gather` / `client.share`: the process group's object gather and broadcast). A
    ServersDown of the main process's request is handed to every process, which all raise it."""
    if client.gather is None:
        return client.generate(prompt_ids, params, seeds)
    shares = client.gather([(prompt_ids, list(seeds))])  # one (prompt_ids, seeds) per process, in rank order
    parts = None
    if client.rank == 0:
        try:
            out = client.generate([row for ids, _ in shares for row in ids], params,
                                  [seed for _, share in shares for seed in share])
        except ServersDown as err:
            parts = [err] * len(shares)
        else:
            parts, start = [], 0
            for ids, _ in shares:
                stop = start + len(ids)
                parts.append(Completions(out.ids[start:stop], out.truncated[start:stop],
                                         None if out.logprobs is None else out.logprobs[start:stop],
                                         None if out.routes is None else out.routes[start:stop]))
                start = stop
    part = client.share(parts)[client.rank]
    if isinstance(part, ServersDown):
        raise part
    return part


def push_tag(step: int | None, queued: bool) -> str:
    """The query arguments of /update_weights after the transport: the step, and whether the push is queued."""
    return ("" if step is None else f"&step={int(step)}") + ("&queued=1" if queued else "")


def update_weights(client, model, step: int | None, queued: bool = False) -> None:
    """Push `model`'s weights with `client.push_weights` from the process that pushes (`client.push`); every
    process walks a sharded model's weights (gathering them is collective), then waits at `client.barrier`."""
    from grpo.engines.sharding import hf_weights, sharding

    if not client.push and sharding(model) is not None:
        for _ in hf_weights(model):  # gathering a sharded model is collective: every process takes part
            pass
    failure = None
    if client.push:
        try:
            client.push_weights(hf_weights(model), step, queued)
        except ServersDown as err:  # (every process learns it below and raises it: none waits at the barrier)
            failure = err
    if client.share is not None:
        failure = client.share(failure)
    if failure is not None:
        raise failure
    if client.barrier is not None:
        client.barrier()
