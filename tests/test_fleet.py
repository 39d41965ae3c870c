"""Several vLLM servers as one rollout engine (grpo.engines.vllm_fleet), with scripted engines behind the real HTTP
endpoints (runs in every environment): rows spread over the servers, every push to every server, a server that
dies taken out, all of them gone a checkpoint and exit 75. The real-vLLM run (1 server against 2, bit for bit) is
in tests/test_vllm_fleet.py.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from grpo.engines.base import Completions, SamplingParams
from grpo.engines.vllm_fleet import VLLMFleet, spread
from grpo.engines.vllm_server import Handler, Served, ServersDown
from test_vllm_server import free_port


class SeededEngine:
    """Completes each row with tokens drawn from its seed alone ([2 + seed % 7, 2 + seed % 5]), so which server
    answers a row does not change it; counts its calls' rows and the tensors it loads. `die_on` (a call number):
    that call takes the server down instead of answering (its connection closed, as a killed process's)."""

    def __init__(self, die_on: int | None = None):
        self.calls, self.loaded, self.eos_ids, self.per_row_seeds = [], [], [], True
        self.die_on, self.server = die_on, None

    def generate(self, prompt_ids, params, seeds):
        self.calls.append(len(prompt_ids))
        if self.die_on is not None and len(self.calls) == self.die_on:
            kill(self.server)
            raise SystemExit  # (not an Exception: the handler's thread ends and its connection closes unanswered)
        return Completions([[2 + s % 7, 2 + s % 5][:params.max_new_tokens] for s in seeds],
                           [False] * len(seeds), [[-1.0, -0.5][:params.max_new_tokens] for _ in seeds])

    def load_weights(self, weights):
        self.loaded.append(sum(t.numel() for _, t in weights))


def free_ports(n: int) -> int:
    """The first of `n` consecutive free local ports (a fleet's weight groups take vllm_group_port + i)."""
    import socket

    while True:
        first, held = free_port(), []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()


def kill(server) -> None:
    """Stop a stub server from any thread: no new connection is accepted after this returns."""
    threading.Thread(target=server.shutdown, daemon=True).start()
    server.socket.close()


@contextlib.contextmanager
def stub_servers(*engines):
    """HTTP servers of grpo vllm-serve's endpoints over `engines`, on free local ports: their URLs."""
    servers = []
    for engine in engines:
        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.served = Served("stub", engine, torch.device("cpu"), state={
            "weights_version": 0, "policy_step": None, "device": "cpu", "device_uuid": None, "dtype": "float32"})
        engine.server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    finally:
        for server in servers:
            kill(server)


def test_spread_keeps_groups_together_and_balances_by_length():
    """Prompts of 5, 1, 1 and 3 tokens, 2 rows each, budget 1 token: weights 12, 4, 4, 8 (2 x (length + 1)).
    Heaviest first to the lightest server: 12 -> A; 8 -> B; 4 (the first short prompt) -> B (8 < 12); 4 -> A or B
    at 12 each: A (the lower index). A: prompts 0 and 2, B: prompts 1 and 3."""
    rows = [[1] * 5] * 2 + [[2]] * 2 + [[3]] * 2 + [[4] * 3] * 2
    assert spread(rows, 2, 1) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert spread(rows, 1, 1) == [list(range(8))]
    assert spread(rows, 5, 1) == [[0, 1], [6, 7], [2, 3], [4, 5], []]


@pytest.mark.parametrize("transport", ["http", "collective"])
def test_two_servers_answer_as_one_and_each_takes_every_push(transport, tmp_path):
    """The same completions from one server and from two (each row's tokens come from its seed), each of the two
    answering its share in one call; a push reaches both servers in full, over gloo groups (one per server) or
    streamed POSTs."""
    model = torch.nn.Linear(3, 2)
    prompts = [[5, 5, 5]] * 2 + [[6]] * 2 + [[7, 7]] * 2
    params = SamplingParams(2)
    one, a, b = SeededEngine(), SeededEngine(), SeededEngine()
    with stub_servers(one) as [url], stub_servers(a, b) as urls:
        single = VLLMFleet([url], [0], timeout=60, transport="http")
        fleet = VLLMFleet(urls, [0], timeout=60, transport=transport, group_port=free_ports(2))
        assert fleet.generate(prompts, params, list(range(6))) == single.generate(prompts, params, list(range(6)))
        assert one.calls == [6] and sorted(a.calls + b.calls) == [2, 4]
        fleet.update_weights(model, step=3)
        assert a.loaded == b.loaded == [8]  # the weight (6) and the bias (2) of the Linear
        assert [m._call("/health")["policy_step"] for m in fleet.members] == [3, 3] and fleet.servers_up == 2
        fleet.close()


def test_a_server_that_is_down_at_start_is_named(tmp_path):
    with stub_servers(SeededEngine()) as [url]:
        dead = f"http://127.0.0.1:{free_port()}"
        with pytest.raises(ConnectionError, match=f"server 2 of 2: no vLLM server answered at {dead} within 1 s"):
            VLLMFleet([url, dead], [0], timeout=1, transport="http")


def test_a_server_that_dies_mid_request_hands_its_rows_to_the_other(capsys):
    """Server B dies in its second request: its rows go to A, the completions are those of an undisturbed run, a
    line names B, and the pushes go on to A alone; when A dies too, ServersDown."""
    model = torch.nn.Linear(3, 2)
    prompts = [[5, 5]] * 2 + [[6, 6]] * 2
    params = SamplingParams(2)
    a, b, ref = SeededEngine(), SeededEngine(die_on=2), SeededEngine()
    with stub_servers(a, b) as urls, stub_servers(ref) as [ref_url]:
        fleet = VLLMFleet(urls, [0], timeout=10, transport="http")
        expected = VLLMFleet([ref_url], [0], timeout=10, transport="http").generate(prompts, params, [0, 1, 2, 3])
        assert fleet.generate(prompts, params, [0, 1, 2, 3]) == expected and a.calls == [2] and b.calls == [2]
        assert fleet.generate(prompts, params, [0, 1, 2, 3]) == expected
        assert a.calls == [2, 2, 2] and b.calls == [2, 2] and fleet.servers_up == 1
        assert f"vLLM server {urls[1]} failed in generation" in capsys.readouterr().err
        fleet.update_weights(model)
        assert a.loaded == [8] and b.loaded == []
        kill(a.server)
        with pytest.raises(ServersDown, match="every vLLM server stopped answering"):
            fleet.generate(prompts, params, [0, 1, 2, 3])
        assert fleet.servers_up == 0


def test_three_servers_share_the_rows_and_two_take_over_from_the_one_that_dies(capsys):
    """Prompts of 4, 2 and 3 tokens, 2 rows each, budget 2 tokens: weights 12, 8, 10, so A takes the first prompt,
    B the third, C the second (heaviest first to the least loaded). C dies in its second request: its 2 rows go
    to A (the retry spreads them over A and B afresh: the lower index), the completions are the undisturbed run's,
    a line names C, and the next request spreads the 3 prompts over A and B (12 -> A, 10 -> B, 8 -> B)."""
    model = torch.nn.Linear(3, 2)
    prompts = [[5] * 4] * 2 + [[6] * 2] * 2 + [[7] * 3] * 2
    params, seeds = SamplingParams(2), list(range(6))
    a, b, c, ref = SeededEngine(), SeededEngine(), SeededEngine(die_on=2), SeededEngine()
    with stub_servers(a, b, c) as urls, stub_servers(ref) as [ref_url]:
        fleet = VLLMFleet(urls, [0], timeout=10, transport="http")
        expected = VLLMFleet([ref_url], [0], timeout=10, transport="http").generate(prompts, params, seeds)
        assert fleet.generate(prompts, params, seeds) == expected and a.calls == b.calls == c.calls == [2]
        assert fleet.generate(prompts, params, seeds) == expected
        assert a.calls == [2, 2, 2] and b.calls == [2, 2] and c.calls == [2, 2] and fleet.servers_up == 2
        assert (f"vLLM server {urls[2]} failed in generation (RemoteDisconnected: Remote end closed connection without"
                " response); 2 of 3 server(s) left, which take its rows") in capsys.readouterr().err
        assert fleet.generate(prompts, params, seeds) == expected and a.calls[-1] == 2 and b.calls[-1] == 4
        fleet.update_weights(model)
        assert a.loaded == b.loaded == [8] and c.loaded == []
        fleet.close()


RECIPE = """\
model_name_or_path: {model}
dataset_name: {data}
task: null
reward_funcs: ["rewards_for_tests:count_a"]
num_generations: 4
prompts_per_step: 2
per_device_train_batch_size: 8
max_completion_length: 2
learning_rate: 1.0e-2
beta: 0.0
max_steps: 4
save_steps: 0
report_to: []
log_completions_steps: 0
use_vllm: true
vllm_mode: server
vllm_weight_transfer: http
vllm_server_timeout: 10
"""


def train(tmp_path, model_dir, urls, out, *extra):
    from test_distributed import job

    env = job(tmp_path, model_dir)
    (tmp_path / "recipe.yaml").write_text(RECIPE.format(model=model_dir, data=tmp_path / "data.jsonl"))
    return subprocess.run([sys.executable, "-m", "grpo.cli", "train", str(tmp_path / "recipe.yaml"),
                           f"output_dir={out}", f"vllm_server_base_url={','.join(urls)}", *extra], env=env,
                          capture_output=True, text=True, timeout=300)


def steps(out) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward/total" in r]


def test_a_run_goes_on_when_a_server_dies_and_stops_with_a_checkpoint_when_all_do(tmp_path, tiny_model_dir):
    """`grpo train` with 3 prompts a step against three stub servers: each takes a prompt's 4 rows; B dies in step
    2's request, the run ends its 4 steps with the line naming B and fleet/servers_up 3, 2, 2, 2; B's rows go to A
    (the lower index of the two left), and in steps 3 and 4 A and C share the 3 prompts (one takes two); the weights
    equal one server's run (each row's tokens come from its seed). Then a run whose servers all die in step 3: exit
    75 with step 2's checkpoint, which resumes against a live server to the same weights."""
    from safetensors.torch import load_file

    three = ("prompts_per_step=3", "per_device_train_batch_size=12")
    with stub_servers(SeededEngine()) as [url]:
        assert train(tmp_path, tiny_model_dir, [url], tmp_path / "one", *three).returncode == 0
    a, b, c = SeededEngine(), SeededEngine(die_on=2), SeededEngine()
    with stub_servers(a, b, c) as urls:
        result = train(tmp_path, tiny_model_dir, urls, tmp_path / "three", *three)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"vLLM server {urls[1]} failed in generation" in result.stderr and "2 of 3 server(s) left" in result.stderr
    assert [r["fleet/servers_up"] for r in steps(tmp_path / "three")] == [3, 2, 2, 2]
    assert (a.calls[:3], b.calls, c.calls[:2]) == ([4, 4, 4], [4, 4], [4, 4])
    assert sorted(a.calls[3:] + c.calls[2:]) == [4, 4, 8, 8]  # (steps 3 and 4: 12 rows each over two servers)
    one, got = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("one", "three"))
    assert all(torch.equal(one[k], got[k]) for k in one)

    with stub_servers(*(SeededEngine(die_on=3) for _ in range(3))) as urls:
        result = train(tmp_path, tiny_model_dir, urls, tmp_path / "down", *three)
    assert result.returncode == 75, result.stderr[-3000:]
    assert "every vLLM server stopped answering" in result.stderr and "after step 2 of 4" in result.stderr
    assert (tmp_path / "down" / "checkpoint-2").is_dir()
    with stub_servers(SeededEngine()) as [url]:
        result = train(tmp_path, tiny_model_dir, [url], tmp_path / "down", *three, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = load_file(str(tmp_path / "down" / "final" / "model.safetensors"))
    assert all(torch.equal(one[k], resumed[k]) for k in one)


def test_two_machine_ranks_against_two_servers_match_one_launch_against_one(tmp_path, tiny_model_dir):
    """The cluster layout in miniature (docs/distributed.md, "Generation nodes"): two launches as machine ranks 0
    and 1 on this machine (one process each, gloo), against two servers named by this machine's host name (the run
    refuses a loopback address on several machines), reach one launch of two processes against one server: the
    same rewards and the same weights, bit for bit."""
    import socket

    from safetensors.torch import load_file

    from test_distributed import job

    env = job(tmp_path, tiny_model_dir)
    (tmp_path / "recipe.yaml").write_text(RECIPE.format(model=tiny_model_dir, data=tmp_path / "data.jsonl"))
    config = Path(__file__).parents[1] / "recipes" / "accelerate" / "ddp_cpu.yaml"

    def launch(out, urls, *machine):
        return subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                                 *machine, "-m", "grpo.cli", "train", str(tmp_path / "recipe.yaml"),
                                 f"output_dir={out}", "per_device_train_batch_size=4",
                                 f"vllm_server_base_url={','.join(urls)}"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(*procs):
        for proc in procs:
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-3000:]

    with stub_servers(SeededEngine()) as [url]:
        finish(launch(tmp_path / "one", [url], "--main_process_port", str(free_port())))
    port, host = str(free_port()), socket.gethostname()
    with stub_servers(SeededEngine(), SeededEngine()) as urls:
        urls = [u.replace("127.0.0.1", host) for u in urls]
        finish(*(launch(tmp_path / "two", urls, "--num_machines", "2", "--num_processes", "2", "--machine_rank",
                        str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port)
                 for rank in (0, 1)))
    assert [r["reward/total"] for r in steps(tmp_path / "one")] == [r["reward/total"] for r in steps(tmp_path / "two")]
    assert [r["fleet/servers_up"] for r in steps(tmp_path / "two")] == [2, 2, 2, 2]
    one, two = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("one", "two"))
    assert all(torch.equal(one[k], two[k]) for k in one)


@pytest.mark.parametrize("lag, die_on, stop, versions", [
    (1, 3, 2, [0, 0, 2, 2]), pytest.param(2, 4, 3, [0, 0, 0, 3], marks=pytest.mark.slow)])  # (lag 2: the slow tier)
def test_with_a_lag_every_server_gone_stops_with_a_checkpoint_that_resumes(lag, die_on, stop, versions, tmp_path,
                                                                        tiny_model_dir):
    """max_staleness 1 and 2, one optimizer step a rollout, each engine one prompt of each rollout. Lag 1: rollout
    r is asked of step r - 1's weights after step r - 1; both servers die in rollout 2's request (their third
    call), step 2's push finds none: exit 75 after step 2, rollout 2 (step 1's weights, gone from the trainer)
    kept as a request of step 2's, rollout 3 asked of step 2's by the resume: versions 0, 0, 2, 2. Lag 2: rollouts
    0-2 asked of step 0's, rollout 3 of step 1's; the servers die in rollout 3's request (the fourth call), which
    step 3 waits for: exit 75 after step 3, rollout 3 sampled again with step 3's weights: 0, 0, 0, 3. The resume
    ends the run's 4 steps. Before: the request thread's failure ended the run with exit 1."""
    with stub_servers(SeededEngine(die_on=die_on), SeededEngine(die_on=die_on)) as urls:
        result = train(tmp_path, tiny_model_dir, urls, tmp_path / "down", f"max_staleness={lag}")
    assert result.returncode == 75, result.stderr[-3000:]
    assert "every vLLM server stopped answering" in result.stderr and f"after step {stop} of 4" in result.stderr
    assert (f"in flight with older weights when the servers stopped: {stop} (step {stop - lag}); the checkpoint of "
            f"step {stop} keeps their prompts and seeds, and a resume samples them with its weights") in result.stderr
    assert (tmp_path / "down" / f"checkpoint-{stop}").is_dir() and not (tmp_path / "down" / "final").exists()
    with stub_servers(SeededEngine()) as [url]:
        result = train(tmp_path, tiny_model_dir, [url], tmp_path / "down", f"max_staleness={lag}", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = steps(tmp_path / "down")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["pipeline/weight_version"] for r in rows] == versions
