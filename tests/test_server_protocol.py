"""`grpo vllm-serve`'s endpoints with a scripted engine in place of vLLM (runs in every environment): what the server
and its client do around the engine, for the GPU layouts the CPU cannot run (gpu_review2 N3, N7).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from http.server import ThreadingHTTPServer

import pytest
import torch

from grpo.agents.endpoint import _Handler as EndpointHandler
from grpo.engines import vllm_weights
from grpo.engines.base import Completions, SamplingParams
from grpo.engines.vllm_server import Handler, Served, VLLMServerClient


class CountingEngine:
    """Completes row r with [first token + 1, seed % 100]; counts its generate calls and their rows."""

    def __init__(self):
        self.calls, self.eos_ids, self.per_row_seeds = [], [], True

    def generate(self, prompt_ids, params, seeds):
        self.calls.append(len(prompt_ids))
        return Completions([[row[0] + 1, seed % 100] for row, seed in zip(prompt_ids, seeds)],
                           [False] * len(prompt_ids), [[-0.5, -0.25] for _ in prompt_ids])

    def load_weights(self, weights):
        for _ in weights:
            pass


@contextlib.contextmanager
def stub_server(device: str = "cpu", uuid: str | None = None):
    """The server's HTTP endpoints over a CountingEngine on a free local port: (url, engine)."""
    engine = CountingEngine()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.served = Served("stub", engine, torch.device(device), state={
        "weights_version": 0, "policy_step": None, "device": device, "device_uuid": uuid, "dtype": "float32"})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", engine
    finally:
        server.shutdown()
        server.server_close()


def test_a_trainer_on_the_servers_own_gpu_is_refused_before_nccl(monkeypatch):
    """Trainer and server on one GPU (a one-GPU box, the default collective transport): NCCL cannot run two ranks of
    one group on one device, and the first broadcast would fail or hang with the server stuck receiving. The client
    compares the devices' UUIDs (as TRL's vllm-serve does) and refuses by name before any group; another GPU goes
    on to open the group. (The UUIDs are faked: the CPU has none.)"""
    opened = []
    monkeypatch.setattr(vllm_weights, "device_uuid", lambda device: "GPU-1111")
    monkeypatch.setattr(vllm_weights, "open_group", lambda *args: opened.append(args) or "group")
    with stub_server("cuda", uuid="GPU-1111") as (url, _):
        with pytest.raises(ConnectionError, match=r"the trainer's cuda:0 and the server at .* are the same GPU "
                                                  r"\(UUID GPU-1111\).*set vllm_weight_transfer: http"):
            VLLMServerClient(url, [0], timeout=5, device="cuda:0", group_port=1)
        assert opened == []
    with stub_server("cuda", uuid="GPU-2222") as (url, _):
        client = VLLMServerClient(url, [0], timeout=5, device="cuda:0", group_port=1)
        assert client.group == "group" and [args[3] for args in opened] == ["nccl", "nccl"]  # (both sides)


def test_lagged_requests_of_two_processes_are_one_engine_call():
    """Server mode with a lag and two trainer processes: each process's request thread sends its own rows (they
    cannot gather over the process group beside the update), and the server runs both parts as one request, as the
    synchronous path's generate_together does; each process gets its own rows back. Before: two engine calls of 2
    rows, one after the other (gpu_review2 N7)."""
    from grpo.training.rollout.pipeline_server import _Pinned

    with stub_server() as (url, engine):
        pinned = [_Pinned(VLLMServerClient(url, [0], timeout=30, push=False, rank=r, processes=2)) for r in (0, 1)]
        got = [None, None]

        def send(r):
            pinned[r].step, pinned[r].index = None, 7
            got[r] = pinned[r].generate_together([[10 * r + 1], [10 * r + 2]], SamplingParams(2), [r, 50 + r])

        threads = [threading.Thread(target=send, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert engine.calls == [4]
        assert got[0].ids == [[2, 0], [3, 50]] and got[1].ids == [[12, 1], [13, 51]]
        # a dynamic-sampling request (no rollout key: each process decides its refill rounds alone) goes alone
        pinned[0].index = None
        assert pinned[0].generate_together([[5]], SamplingParams(2), [3]).ids == [[6, 3]]
        assert engine.calls == [4, 1]


class FakeGroup:
    def __init__(self, log, side):
        self.log, self.side = log, side

    def shutdown(self):
        self.log.append(("shutdown", self.side))


def test_the_weight_group_takes_the_configured_timeout_and_is_shut_down(monkeypatch):
    """NCCL's group gets vllm_server_timeout as gloo's does (before: torch's fixed 10 minutes, gpu_review2 N13); the
    client shuts its side down when closed (registered at exit, as TRL's client) and the server shuts an earlier
    trainer's group down when the next one joins."""
    import datetime

    import torch.distributed as dist

    made = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", lambda store, rank, size, timeout: made.append((rank, timeout)),
                        raising=False)  # (a CPU build of torch has none)
    stores = []
    monkeypatch.setattr(dist, "TCPStore", lambda host, port, size, is_master, timeout: stores.append(timeout) or
                        dist.HashStore())  # (no second rank here to join a real store)
    vllm_weights.open_group("127.0.0.1", 1, 0, "nccl", timeout=7.0)
    assert made == [(0, datetime.timedelta(seconds=7))] and stores == [datetime.timedelta(seconds=7)]

    log = []
    monkeypatch.setattr(vllm_weights, "open_group", lambda host, port, rank, *args: FakeGroup(log, rank))
    with stub_server() as (url, _):
        first = VLLMServerClient(url, [0], timeout=5, group_port=1)
        second = VLLMServerClient(url, [0], timeout=5, group_port=1)
        assert log == [("shutdown", 1)]  # the server's side of the first trainer's group
        first.close()
        first.close()
        assert log == [("shutdown", 1), ("shutdown", 0)] and first.group is None and second.group is not None


class _Procs:
    def __init__(self, others_failed: bool):
        self.others_failed = others_failed

    def gather_objects(self, rows):  # (this process is rank 1 of 2; rank 0's outcome as given)
        return ["failed" if self.others_failed else None, *rows]


@pytest.mark.parametrize("here, there", [(False, True), (True, False), (False, False)])
def test_a_failed_request_thread_stops_every_process_together(here, there):
    """Server mode with a lag and two processes: a failure in one process's request thread (its rewards raised, the
    server answered 500) is shared at the push's barrier, so every process raises there instead of the others
    waiting in their next collective until the timeout (gpu_review2 N14); without failures the weights go out."""
    import types

    from grpo.training.rollout.pipeline import Answers
    from grpo.training.rollout.pipeline_server import ServerRollouts

    pushed = []
    source = object.__new__(ServerRollouts)
    source.pushed, source.step, source.policy, source.pushing = 0, 1, "policy", 0.0
    source.copy = "the host copy"
    source.worker = types.SimpleNamespace(who="vLLM server requests", failure="my rewards raised" if here else None,
                                          push=lambda version, host, policy: pushed.append((policy, version, host)))
    source.worker.error = lambda: Answers.error(source.worker)
    source.client = types.SimpleNamespace(push=True, barrier=lambda: None)  # (the main process of two)
    source.rollouts = types.SimpleNamespace(procs=_Procs(others_failed=there))
    if here or there:
        with pytest.raises(RuntimeError, match="my rewards raised" if here else
                           "a rollout failed on process 0 .* every process stops with it"):
            source._send_weights(1)
        assert pushed == []
    else:
        source._send_weights(1)
        assert pushed == [("policy", 1, "the host copy")]


def test_the_generate_records_round_trip_merge_split_and_name_a_missing_field():
    from grpo.engines.vllm_protocol import GenerateReply, GenerateRequest, Part

    params = SamplingParams(max_new_tokens=3, temperature=0.7)
    a = GenerateRequest([[1, 2], [3]], params, [10, 11], [0], step=4, together=Part("r4", 2, 0, 30.0))
    b = GenerateRequest([[5]], params, [12], [0], step=4, together=Part("r4", 2, 1, 30.0))
    assert GenerateRequest.from_json(a.to_dict()) == a  # (through JSON's types: lists, dicts, numbers)
    whole = GenerateRequest.merged([a, b])
    assert whole.prompt_ids == [[1, 2], [3], [5]] and whole.seeds == [10, 11, 12] and whole.together is None
    assert whole.step == 4 and whole.params == params
    # The merged reply cut back into the parts' rows: 2 rows, then 1; the step goes with each part.
    reply = GenerateReply(Completions([[7], [8], [9]], [False, True, False], [[-1.0], [-2.0], [-3.0]]), 4)
    first, second = reply.split([2, 1])
    assert first.completions.ids == [[7], [8]] and first.completions.truncated == [False, True]
    assert second.completions.logprobs == [[-3.0]] and second.policy_step == 4
    assert GenerateReply.from_json(reply.to_dict()) == reply
    body = a.to_dict()
    del body["eos_ids"]
    with pytest.raises(ValueError, match="/generate: the body lacks eos_ids"):
        GenerateRequest.from_json(body)


def test_the_host_copy_of_the_weights_holds_them_as_they_were_and_reuses_its_buffers():
    """HostCopy (the push thread's copy, grpo.training.rollout.pipeline_server): floating tensors in the engine's
    dtype (1/3 in bfloat16 is 0.333984375: 8 bits of mantissa), integer ones as they are; an in-place change of the
    weights after the copy does not reach it; the next copy reuses the same buffers (one version in host memory)."""
    weights = {"w": torch.full((2, 3), 1 / 3), "steps": torch.tensor([7, 8], dtype=torch.int64)}
    host = vllm_weights.HostCopy()
    first = dict(host.take(weights.items(), torch.bfloat16))
    weights["w"].add_(1.0)
    assert first["w"].dtype == torch.bfloat16 and first["w"].tolist() == [[0.333984375] * 3] * 2
    assert first["steps"].dtype == torch.int64 and first["steps"].tolist() == [7, 8]
    second = dict(host.take(weights.items(), torch.bfloat16))
    assert second["w"].data_ptr() == first["w"].data_ptr() and second["w"][0, 0].item() == 1.3359375


@pytest.mark.parametrize("handler", [Handler, EndpointHandler], ids=["vllm-serve", "agent-endpoint"])
def test_the_servers_sockets_send_replies_without_waiting_for_the_clients_ack(handler):
    """http.server writes a reply's headers and body apart; with Nagle's algorithm on, a kept-alive connection held
    the body until the client's delayed ACK of the headers: 40 ms a reply on Linux (an agent's openai client took
    44 ms a call, 2 ms with it off). Both servers' connections must have TCP_NODELAY set."""
    seen = threading.Event()
    nodelay = []

    class Probe(handler):
        def setup(self):
            super().setup()
            nodelay.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            seen.set()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Probe)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        socket.create_connection(server.server_address).close()
        assert seen.wait(30)
    finally:
        server.shutdown()
        server.server_close()
    assert nodelay == [1]
