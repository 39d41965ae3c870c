"""Pushes queued at the vLLM server (grpo.engines.vllm_pushes), so that with max_staleness k the server generates
rollouts t + 1 .. t + k while the trainer updates on rollout t; scripted engines behind the real HTTP endpoints
(runs in every environment). The real-vLLM lag tests (versions through the log-probs, kill and resume):
tests/test_vllm_async.py.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from grpo.engines.base import SamplingParams
from grpo.engines.vllm_server import VLLMServerClient
from test_fleet import SeededEngine, free_ports, stub_servers
from test_resume import read_rows, run_driver
from test_vllm_server import free_port


def test_a_queued_push_waits_for_the_request_that_names_it():
    """A queued push of step 1 is staged: a request for step 0 still runs on the weights it names, the one for
    step 1 loads the push first, and step 0 is then refused. A second queued push waits while one is staged (host
    memory: one version) and goes on when the first is loaded; an unqueued push loads at once and drops a staged
    one."""
    model, params = torch.nn.Linear(3, 2), SamplingParams(2)
    engine = SeededEngine()
    with stub_servers(engine) as [url]:
        client = VLLMServerClient(url, [0], timeout=60, transport="http")
        health = lambda: client._call("/health")  # noqa: E731
        client.update_weights(model, step=0)
        client.update_weights(model, step=1, queued=True)
        assert (health()["policy_step"], health()["staged_step"], len(engine.loaded)) == (0, 1, 1)
        assert client.generate_at([[5]], params, [0], step=0)[1] == 0 and len(engine.loaded) == 1
        assert client.generate_at([[5]], params, [0], step=1)[1] == 1 and len(engine.loaded) == 2
        with pytest.raises(RuntimeError, match="names the weights of step 0, the server holds those of step 1"):
            client.generate_at([[5]], params, [0], step=0)

        client.update_weights(model, step=2, queued=True)
        second = threading.Thread(target=client.update_weights, args=(model, 3, True))
        second.start()
        second.join(timeout=1.0)
        assert second.is_alive() and health()["staged_step"] == 2  # (waits: step 2 is staged)
        assert client.generate_at([[5]], params, [0], step=2)[1] == 2
        second.join(timeout=60)
        assert not second.is_alive() and health()["staged_step"] == 3
        client.update_weights(model, step=9)
        assert (health()["policy_step"], health()["staged_step"]) == (9, None)
        assert health()["weights_version"] == 5  # (pushes of steps 0, 1, 2, 3 and 9)


def test_a_queued_collective_push_waits_for_the_slot_outside_the_group():
    """Over a gloo group whose collectives time out after 3 s (vllm_server_timeout): a queued push made while
    another is staged waits (here 5 s) for the server to load that one, then goes through. It waits over HTTP
    (/wait_unstaged), not inside the group's broadcast, which would have timed out and broken the group."""
    model, params = torch.nn.Linear(3, 2), SamplingParams(2)
    engine = SeededEngine()
    with stub_servers(engine) as [url]:
        client = VLLMServerClient(url, [0], timeout=3, transport="collective", group_port=free_port())
        client.update_weights(model, step=0)
        client.update_weights(model, step=1, queued=True)
        failed = []
        push = threading.Thread(target=lambda: failed.extend(_raised(client.update_weights, model, 2, True)))
        push.start()
        push.join(timeout=5.0)
        assert push.is_alive() and client._call("/health")["staged_step"] == 1
        assert client.generate_at([[5]], params, [0], step=1)[1] == 1
        push.join(timeout=60)
        assert failed == [] and client._call("/health")["staged_step"] == 2 and engine.loaded == [8, 8]
        client.close()


def _raised(call, *args) -> list[BaseException]:
    try:
        call(*args)
    except Exception as err:  # noqa: BLE001 - the test reports it
        return [err]
    return []


@pytest.mark.parametrize("transport", ["http", "collective"])
def test_a_server_given_no_rows_still_loads_the_push_its_step_names(transport):
    """Two servers, requests of one row naming steps 1 then 2, each after its queued push: the server without rows
    gets an empty part naming the step and loads the staged push, so the next push does not wait behind it for
    ever (as it did before: only servers with rows were asked)."""
    from grpo.engines.vllm_fleet import VLLMFleet

    model, params = torch.nn.Linear(3, 2), SamplingParams(2)
    a, b = SeededEngine(), SeededEngine()
    with stub_servers(a, b) as urls:
        fleet = VLLMFleet(urls, [0], timeout=60, transport=transport, group_port=free_ports(2))
        fleet.update_weights(model, step=0)
        for step in (1, 2, 3):
            push = threading.Thread(target=fleet.update_weights, args=(model, step, True))
            push.start()
            push.join(timeout=60)
            assert not push.is_alive(), step
            assert fleet.generate_at([[5]], params, [step], step=step)[1] == step
        assert len(a.loaded) == len(b.loaded) == 4 and sorted([len(a.calls), len(b.calls)]) == [0, 3]
        fleet.close()


@pytest.mark.parametrize("transport", ["http", "collective"])
def test_a_push_waiting_for_the_slot_does_not_hold_up_the_request_that_frees_it(transport):
    """One server, lag 2's order: push 1 staged, then push 2 sent while no request has named step 1 yet (it waits
    at the server for the slot), then the request naming step 1, which loads push 1 and frees the slot. Pushes and
    requests have threads of their own in the fleet: with one pool of a thread per server the request waited behind
    the push and the push for the request, for ever (bench.server_lag's lag 2 against a real server, collective)."""
    from grpo.engines.vllm_fleet import VLLMFleet

    model, params = torch.nn.Linear(3, 2), SamplingParams(2)
    engine = SeededEngine()
    with stub_servers(engine) as urls:
        fleet = VLLMFleet(urls, [0], timeout=60, transport=transport, group_port=free_ports(1))
        fleet.update_weights(model, step=0)
        fleet.update_weights(model, step=1, queued=True)
        push = threading.Thread(target=fleet.update_weights, args=(model, 2, True), daemon=True)
        push.start()
        time.sleep(0.5)  # (the push waits at the server: its slot holds step 1's)
        asked = threading.Thread(target=fleet.generate_at, args=([[5]], params, [1]), kwargs={"step": 1},
                                 daemon=True)
        asked.start()
        asked.join(timeout=60)
        push.join(timeout=60)
        assert not asked.is_alive() and not push.is_alive()
        assert fleet.generate_at([[5]], params, [2], step=2)[1] == 2
        fleet.close()


class WaitingEngine(SeededEngine):
    """A SeededEngine whose request for the weights of step v in `hold` (rollout v + 2 at lag 2, one step a rollout)
    does not finish until the trainer's next push (of step v + 1) has reached the server. The trainer pushes step
    v + 1 only after its update on rollout v, so each such request is in flight for the whole update on rollout v;
    a trainer that waited for the server's requests before pushing would wait for this one forever (the engine
    gives up after 60 s and records it)."""

    def __init__(self, hold: tuple[int, ...]):
        super().__init__()
        self.hold = hold
        self.seen: list[tuple[int, bool]] = []  # (the step the request named, whether a push came while it ran)

    def generate(self, prompt_ids, params, seeds):
        state = self.server.served.state
        held = state["policy_step"]
        came = True
        if held in self.hold:
            deadline = time.monotonic() + 60
            while state["staged_step"] is None and time.monotonic() < deadline:
                time.sleep(0.01)
            came = state["staged_step"] == held + 1
        self.seen.append((held, came))
        return super().generate(prompt_ids, params, seeds)


def config(model, url, out, **extra) -> dict:
    """Lag 2, one optimizer step a rollout (2 prompts x 4 completions in 2 micro-batches), 6 steps."""
    return {**dict(model_name_or_path=str(model), task=None, num_generations=4, prompts_per_step=2,
                   per_device_train_batch_size=4, gradient_accumulation_steps=2, max_completion_length=2,
                   learning_rate=2e-2, beta=0.0, max_steps=6, save_steps=1, save_total_limit=None, report_to=[], log_completions_steps=0, seed=0,
                   output_dir=str(out), use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                   vllm_server_timeout=120, vllm_weight_transfer="http", max_staleness=2), **extra}


def test_with_lag_2_the_server_runs_two_rollouts_ahead_and_resume_is_exact(tmp_path, tiny_model_dir):
    """Lag 2: rollout t + 2 (the weights of step t) is in flight during the whole update on rollout t (the engine
    holds it until the push after that update arrives: before the queue, the trainer waited for it before pushing,
    and this run hung); each rollout names the weights of step t - 2 and the server sampled with them. A kill -9
    inside step 3's update, then a resume, reaches the same weights bit for bit."""
    engine = WaitingEngine(hold=(1, 2))  # (no push follows step 3's: no rollout names step 4)
    with stub_servers(engine) as [url]:
        assert run_driver(config(tiny_model_dir, url, tmp_path / "straight"), tmp_path, "none", 0) == 0
    rows = read_rows(tmp_path / "straight")
    assert [r["pipeline/weight_version"] for r in rows] == [0, 0, 0, 1, 2, 3]
    # (rollouts 0, 1, 2 name step 0; rollouts 3 and 4, held by the engine, saw the next push come while they ran)
    assert engine.seen == [(0, True), (0, True), (0, True), (1, True), (2, True), (3, True)]
    want = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))

    with stub_servers(SeededEngine()) as [url]:
        cfg = config(tiny_model_dir, url, tmp_path / "run")
        assert run_driver(cfg, tmp_path, "micro_step", 3) == -signal.SIGKILL
        assert run_driver({**cfg, "resume": True}, tmp_path, "none", 0) == 0
    got = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert [r["pipeline/weight_version"] for r in read_rows(tmp_path / "run")] == [0, 0, 0, 1, 2, 3]


def test_with_one_process_the_push_goes_out_while_the_next_update_runs(tmp_path, tiny_model_dir, monkeypatch):
    """Lag 1, one optimizer step a rollout: the server takes in the push of step 1 only once the trainer has taken
    optimizer step 2 (its update on rollout 1, which names step 0's weights). The push thread sends the push meanwhile and
    the request for rollout 2 waits for it; a trainer that pushed on its own path would wait in that push for its
    own step 2 (the server gives up after 60 s, and records that it did). Each rollout names the weights of
    step t - 1, and the push's seconds are the thread's (`pipeline/weight_push_thread`)."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.engines import vllm_pushes
    from rewards_for_tests import count_a

    ended, taken = {step: threading.Event() for step in range(1, 7)}, []
    came, stage = [], vllm_pushes.PushQueue.stage

    def stage_late(self, weights, step, state):
        if step == 1:
            came.append(ended[2].wait(60))
        return stage(self, weights, step, state)

    class Steps(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            taken.append(1)
            ended[len(taken)].set()

    monkeypatch.setattr(vllm_pushes.PushQueue, "stage", stage_late)
    with stub_servers(SeededEngine()) as [url]:
        cfg = config(tiny_model_dir, url, tmp_path / "run", max_staleness=1, max_steps=4, save_steps=0)
        trainer = GRPOTrainer(reward_funcs=[count_a], args=GRPOConfig(**cfg), callbacks=[Steps()],
                              train_dataset=Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]}))
        trainer.train()
    assert came == [True]
    rows = read_rows(tmp_path / "run")
    assert [r["pipeline/weight_version"] for r in rows] == [0, 0, 1, 2]
    assert all(r["pipeline/weight_push_thread"] >= 0 for r in rows)


def test_a_process_that_does_not_push_waits_until_the_servers_have_the_step():
    """Several trainer processes: the main one's push thread sends step 1 while another process's client thread
    is about to ask for it; that thread waits (`wait_for_step`) until every server holds or has staged step 1."""
    from grpo.engines.vllm_fleet import VLLMFleet

    model = torch.nn.Linear(3, 2)
    with stub_servers(SeededEngine(), SeededEngine()) as urls:
        fleet = VLLMFleet(urls, [0], timeout=60, transport="http")
        fleet.update_weights(model, step=0)
        seen = []
        waiter = threading.Thread(target=lambda: seen.append(fleet.wait_for_step(1) or [
            m._call("/health")["staged_step"] for m in fleet.members]))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and seen == []  # (no push of step 1 yet)
        fleet.update_weights(model, step=1, queued=True)
        waiter.join(timeout=60)
        assert seen == [[1, 1]]
        fleet.wait_for_step(0)  # (held: at once)
        fleet.close()


def test_multi_turn_processes_meet_after_each_rollout_before_asking_for_newer_weights():
    """Two trainer processes with multi-turn rollouts (each process's turns go alone): the fence after rollout 0 (a
    request of no rows naming its step, joined over the processes) returns to neither process until both have sent
    it, so the first to finish cannot ask for step 1's weights (which the server would load) while the other still
    has turns of step 0 to send."""
    from grpo.engines.vllm_fleet import VLLMFleet
    from grpo.training.rollout.pipeline_server import _Pinned

    model, params = torch.nn.Linear(3, 2), SamplingParams(2)
    engine = SeededEngine()
    with stub_servers(engine) as [url]:
        first, second = (VLLMFleet([url], [0], timeout=60, push=rank == 0, transport="http", rank=rank, processes=2)
                         for rank in (0, 1))
        first.update_weights(model, step=0)
        first.update_weights(model, step=1, queued=True)
        pinned = [_Pinned(first), _Pinned(second)]
        for p in pinned:
            p.step = 0
        fenced = threading.Thread(target=pinned[0].fence, args=(0, params))
        fenced.start()
        fenced.join(timeout=1.0)
        assert fenced.is_alive()  # (process 1 has not finished rollout 0)
        assert pinned[1].generate([[5]], params, [3]).ids == [[5, 5]]  # (its last turn: step 0's weights, still held)
        pinned[1].fence(0, params)
        fenced.join(timeout=60)
        assert not fenced.is_alive()
        assert first.generate_at([[5]], params, [4], step=1)[1] == 1  # (now step 1's weights load)
        assert first.members[0]._call("/health")["policy_step"] == 1
        first.close()
        second.close()
