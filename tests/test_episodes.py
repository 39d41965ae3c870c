"""Agents as rollouts (grpo.agents.episodes): a user's `episode(client, row)` with the real `openai` client against
the endpoint serving the policy, trained on token-exactly; faults counted; an episode's separate chains as rows."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")

from datasets import Dataset  # noqa: E402

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo.agents import Episodes  # noqa: E402
from grpo.agents.tools import calculator  # noqa: E402
from grpo.config import ConfigError  # noqa: E402
from grpo.tasks import calculator as calculator_task  # noqa: E402
from conftest import load_script  # (at the top: tests/trl_suite has a conftest too)

ASSET = str(Path(__file__).resolve().parents[1] / "grpo" / "assets" / "tiny-tools")
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Exact arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def config(tmp_path, **overrides) -> GRPOConfig:
    values = dict(output_dir=str(tmp_path / "run"), task=None, num_generations=2, prompts_per_step=2,
                  max_completion_length=96, max_steps=1, report_to=[], save_steps=0, learning_rate=1e-3,
                  log_completions_steps=0, beta=0.0, seed=3, temperature=1.0)
    values.update(overrides)
    return GRPOConfig(**values)


def problems(n: int = 8) -> Dataset:
    return Dataset.from_list(calculator_task.rows("train", n, seed=0))


def messages(row) -> list[dict]:
    return [{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str) else list(row["prompt"])


def calculator_agent(seen: list | None = None):
    """The calculator task as an agent of the openai client: the model may call the calculator, then answers."""
    def episode(client, row):
        history = messages(row)
        for _ in range(3):
            reply = client.chat.completions.create(model="policy", messages=history, tools=TOOLS,
                                                   extra_body={"return_token_ids": True})
            if seen is not None:
                seen.append((str(client.base_url), reply.prompt_token_ids, reply.choices[0].token_ids))
            message = reply.choices[0].message
            history.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)
                try:
                    answer = calculator(**arguments)
                except Exception as err:  # noqa: BLE001 - the model's bad call is answered, as a tool loop does
                    answer = f"Error: {err}"
                history.append({"role": "tool", "tool_call_id": call.id, "content": str(answer)})
        text = history[-1].get("content") or ""
        return {"reward": float(f"<answer>{row['answer']}</answer>" in text), "turns": len(history)}
    return episode


def test_an_agent_trains_through_the_endpoint_on_exactly_the_ids_it_was_served(tmp_path):
    seen = []
    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path), train_dataset=problems(), reward_funcs=[],
                          rollout_func=Episodes(calculator_agent(seen)))
    batch = trainer.rollout()
    T = batch.completion_width
    episodes = {}  # the calls of each episode as the endpoint reported them to the agent, by its base_url
    for url, prompt_ids, ids in seen:
        episodes.setdefault(url, []).append((prompt_ids, ids))
    assert batch.input_ids.shape[0] == len(episodes) == 4  # (each episode's calls extend its last: one row each)
    for row, url in enumerate(sorted(episodes, key=lambda u: int(u.split("/episodes/e")[1].split("/")[0]))):
        calls = episodes[url]
        full = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        trained = batch.input_ids[row, -T:][batch.completion_mask[row].bool()].tolist()
        assert full == calls[-1][0] + calls[-1][1]  # the last call's prompt and sampled ids, as served
        assert trained == [t for _, ids in calls for t in ids]  # every call's sampled ids, and nothing else
    assert batch.metrics["episodes/model_calls"] == len(seen) and batch.metrics["episodes/raised"] == 0
    assert 0 <= batch.metrics["reward/episode"] <= 1 and batch.metrics["episode/turns"] >= 2

    # The same run again samples the same trajectories (seeds from the row and the call's index).
    again = GRPOTrainer(model=ASSET, args=config(tmp_path / "again"), train_dataset=problems(), reward_funcs=[],
                        rollout_func=Episodes(calculator_agent()))
    assert torch.equal(again.rollout().input_ids, batch.input_ids)


def test_a_short_training_run_through_the_endpoint(tmp_path):
    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path, max_steps=2), train_dataset=problems(),
                          reward_funcs=[], rollout_func=Episodes(calculator_agent()))
    metrics = trainer.train()
    assert trainer.step == 2 and "reward/episode" in metrics and metrics["episodes/no_calls"] == 0


def test_faults_are_counted_and_the_run_goes_on(tmp_path):
    """Of four episodes: one raises, one overruns its deadline, one never calls the model, one returns a string."""
    def episode(client, row):
        kind = ["raise", "slow", "silent", "bad"][episode.count % 4]
        episode.count += 1
        client.chat.completions.create(model="policy", messages=messages(row), max_tokens=3) if kind != "silent" \
            else None
        if kind == "raise":
            raise ValueError("the agent's own bug")
        if kind == "slow":
            time.sleep(5)
            client.chat.completions.create(model="policy", messages=messages(row), max_tokens=3)  # refused: 404
        return "not a number" if kind == "bad" else 1.0

    episode.count = 0
    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path, num_generations=4, prompts_per_step=1),
                          train_dataset=problems(), reward_funcs=[], rollout_func=Episodes(episode, timeout_s=1.0))
    batch = trainer.rollout()
    assert {k: batch.metrics[f"episodes/{k}"] for k in ("raised", "timeout", "no_calls", "bad_return")} == {
        "raised": 1.0, "timeout": 1.0, "no_calls": 1.0, "bad_return": 1.0}
    assert batch.completion_mask.sum() == 0  # nothing of a failed episode is trained
    assert all(math.isnan(r["reward"]) for r in batch.samples)  # (None: the silent one's 1.0 is not taken)
    assert batch.advantages.abs().sum() == 0


def test_an_episodes_separate_chains_are_rows_with_its_advantage(tmp_path):
    """An async agent that asks twice without history makes two chains: two rows, one advantage."""
    async def episode(client, row):
        for turn in range(2):
            await client.chat.completions.create(model="policy", messages=messages(row) + [
                {"role": "user", "content": f"Attempt {turn}."}], max_tokens=4)
        return float("/episodes/e0/" in str(client.base_url))  # (episodes open in row order: row 0 gets 1)

    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path), train_dataset=problems(), reward_funcs=[],
                          rollout_func=Episodes(episode))
    batch = trainer.rollout()
    assert batch.input_ids.shape[0] == 8 and batch.metrics["episodes/extra_rows"] == 4
    # Rewards (1, 0) and (0, 0); (r - mean) / (std + eps): for (1, 0) mean 0.5, unbiased std 0.70711, eps 1e-4 ->
    # +-0.5 / 0.70721 = +-0.70700; for (0, 0) 0.
    expected = torch.tensor([0.70700, -0.70700, 0.0, 0.0])
    assert torch.allclose(batch.advantages, torch.cat([expected, expected]), atol=1e-4)
    assert (batch.completion_mask.sum(1) > 0).all()


def test_episodes_refuse_what_they_cannot_do(tmp_path):
    with pytest.raises(ConfigError, match="^Episodes: timeout_s must be > 0"):
        Episodes(lambda client, row: 1.0, timeout_s=0)
    with pytest.raises(ConfigError, match="^Episodes: episode must be a function"):
        Episodes("not a function")
    # Several processes on one host serve an endpoint each: a fixed port would be taken twice (refused before any
    # model loads).
    from types import SimpleNamespace

    from grpo.agents import make_agent_spec

    with pytest.raises(ConfigError, match=r"^rollout_func: Episodes\(port=8123\) on 2 processes: .* leave port 0"):
        make_agent_spec(config(tmp_path), rollout_func=Episodes(lambda client, row: 1.0, port=8123),
                        accelerator=SimpleNamespace(num_processes=2))
    # An episode's extra rows on one of several processes: every process raises (the counts are gathered), naming
    # them; none is a no-op.
    from grpo.agents.episodes import one_row_each

    other = {"extra": 3}
    procs = SimpleNamespace(world=2, gather=lambda t: torch.cat([t, torch.tensor([other["extra"]])]))
    with pytest.raises(RuntimeError, match=r"^Episodes on 2 processes: .*extra rows per process: \[0, 3\]"):
        one_row_each(procs, [])
    other["extra"] = 0
    one_row_each(procs, None)


def test_an_agent_with_a_lag_is_served_from_the_rollout_workers_weights(tmp_path):
    """max_staleness 1: the episodes run in the forked rollout worker, against an endpoint served there from the
    worker's engine. Rollout t's rows (the log-probs the endpoint recorded as it sampled, extra rows included) are
    those of the trainer's weights at rollout max(0, t - 1), not of the versions next to it; the logged weight
    versions say so; the run trains. (1e-4: the engine-vs-update tolerance of the test above; a step moves the
    tiny model's log-probs by more than 1e-3 at this learning rate, as tests/test_async.py holds it to.)"""
    from test_async import recording, version_gaps

    async def episode(client, row):
        await client.chat.completions.create(model="policy", messages=messages(row), tools=TOOLS, max_tokens=24)
        await client.chat.completions.create(model="policy", messages=messages(row) + [
            {"role": "user", "content": "Again."}], tools=TOOLS, max_tokens=24)
        # (a group's two episodes are e2k and e2k+1: rewards 1 and 0, so every step moves the weights)
        return float(int(str(client.base_url).split("/episodes/e")[1].split("/")[0]) % 2 == 0)

    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path, max_staleness=1, max_steps=4, num_threads=1,
                                                   learning_rate=3e-3), train_dataset=problems(16),
                          reward_funcs=[], rollout_func=Episodes(episode))
    snapshots, batches = recording(trainer)
    trainer.train()
    trainer.backend.prepare()
    told_apart = 0
    for t, batch in batches.items():
        want = max(0, t - 1)
        assert batch.metrics["pipeline/weight_version"] == want and batch.metrics["episodes/model_calls"] == 8
        gaps, moved = version_gaps(trainer, snapshots, batch, want)
        assert gaps[want] < 1e-4, (t, gaps)
        assert all(gaps[v] > 1e-3 for v in moved), (t, gaps)
        told_apart += len(moved)
    assert sorted(batches) == [0, 1, 2, 3] and told_apart >= 2


def test_dynamic_sampling_keeps_a_kept_episodes_extra_rows_with_it(tmp_path):
    """Groups whose rewards are all equal are dropped with their episodes' extra rows (Sampled.select / concat)."""
    async def episode(client, row):
        for turn in range(2):
            await client.chat.completions.create(model="policy", messages=messages(row) + [
                {"role": "user", "content": f"Attempt {turn}."}], max_tokens=4)
        return float("/episodes/e0/" in str(client.base_url))  # round 1: (1, 0), (0, 0); round 2: all 0

    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path, dynamic_sampling=True, max_generation_rounds=2),
                          train_dataset=problems(), reward_funcs=[], rollout_func=Episodes(episode))
    batch = trainer.rollout()
    assert batch.metrics["sampling/kept_groups"] == 1 and batch.input_ids.shape[0] == 4
    assert torch.allclose(batch.advantages, torch.tensor([0.70700, -0.70700, 0.70700, -0.70700]), atol=1e-4)
    first_rows = batch.input_ids[:2, :]
    assert not torch.equal(first_rows, batch.input_ids[2:, :])  # the extra rows are the second chains


@pytest.mark.parametrize("processes", [0, 2])
def test_an_openai_agents_sdk_agent_trains_through_the_endpoint(tmp_path, processes):
    """scripts/agents_sdk_calculator.py's agent (an Agents SDK Agent with a function tool, unchanged): its calls
    extend one another, so each episode is one row, and nothing drifted from what was sampled; in the trainer's
    process and in two forked workers."""
    pytest.importorskip("agents")

    script = load_script("agents_sdk_calculator")
    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path, num_generations=4, max_completion_length=128),
                          train_dataset=problems(), reward_funcs=[],
                          rollout_func=Episodes(script.episode, processes=processes))
    batch = trainer.rollout()
    assert batch.input_ids.shape[0] == 8 and batch.metrics["episodes/extra_rows"] == 0
    assert batch.metrics["episodes/drift"] == 0 and batch.metrics["episodes/raised"] == 0
    assert batch.metrics["episodes/model_calls"] >= 8 and batch.completion_mask.sum() > 0


def test_the_engines_logprobs_are_the_update_passes_on_every_trained_token(tmp_path):
    """The log-probs the endpoint recorded (the engine's, as it sampled) equal the update pass's log-probs of the
    same tokens at the same weights, on every row, extra rows included: the ids trained are the ids sampled, at the
    same positions. Float32 on both sides; 1e-4 is the tolerance tests/test_tiny_tools_model.py holds the CPU engine
    and the transformers sampler to."""
    async def episode(client, row):
        await client.chat.completions.create(model="policy", messages=messages(row), tools=TOOLS)
        await client.chat.completions.create(model="policy", messages=messages(row) + [
            {"role": "user", "content": "Again."}], tools=TOOLS)
        return float("/episodes/e0/" in str(client.base_url))

    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path), train_dataset=problems(), reward_funcs=[],
                          rollout_func=Episodes(episode))
    batch = trainer.rollout()
    assert batch.input_ids.shape[0] == 8 and batch.sampling_logp is not None
    update = trainer.updates.score(trainer.policy, batch)
    mask = batch.completion_mask.bool()
    assert mask.sum() > 0 and (batch.sampling_logp[mask] < 0).all()
    assert torch.allclose(update.cpu()[mask], batch.sampling_logp[mask], atol=1e-4, rtol=0)


@pytest.mark.slow  # (three training processes: about a minute)
def test_a_run_through_the_endpoint_killed_and_resumed_ends_bit_exact(tmp_path):
    import signal
    import subprocess
    import sys

    from safetensors.torch import load_file

    driver = Path(__file__).parent / "episodes_resume_driver.py"
    cfg = dict(model_name_or_path=ASSET, task=None, num_generations=2, prompts_per_step=2, max_completion_length=64,
               max_steps=2, save_steps=1, report_to=[], learning_rate=1e-3, log_completions_steps=0, beta=0.04,
               seed=3, temperature=1.0)

    def run(name: str, kill_step: int, **more) -> int:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({**cfg, "output_dir": str(tmp_path / name), **more}))
        proc = subprocess.run([sys.executable, str(driver), str(path), str(kill_step)], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode not in (0, -signal.SIGKILL):
            print(proc.stderr[-4000:])
        return proc.returncode

    assert run("straight", 0) == 0
    assert run("killed", 2) == -signal.SIGKILL  # (inside an episode of step 2; step 1's checkpoint saved)
    assert not (tmp_path / "killed" / "final").exists()
    assert run("killed", 0, resume=True) == 0
    want = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    got = load_file(str(tmp_path / "killed" / "final" / "model.safetensors"))
    assert max((got[k] - want[k]).abs().max().item() for k in want) == 0.0
    rows = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    straight = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    keys = ("reward/total", "policy/loss", "train/grad_norm", "episodes/model_calls")
    assert [[r.get(k) for k in keys] for r in rows] == [[r.get(k) for k in keys] for r in straight]


calculator_episode = calculator_agent()  # (an episode function by path, as a recipe's `agent` names it)


def tool_calling_episode(client, row) -> float:
    """calculator_episode rewarded for calling the calculator (tiny-tools does in about a third of its turns: groups
    differ in reward, so the weights move), as tests/test_distributed.py's tool run is."""
    return float(calculator_episode(client, row)["turns"] > 2)


def test_a_config_trains_an_agent_by_its_path_with_the_tasks_data_and_the_episodes_reward(tmp_path):
    args = config(tmp_path, task="calculator", agent="test_episodes:calculator_episode")
    trainer = GRPOTrainer(model=ASSET, args=args)
    assert isinstance(trainer.agents.rollout_func, Episodes) and trainer.reward_names == ["episode"]  # (not the
    # task's math_accuracy as well: the episode's return is the reward)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["episodes/model_calls"] >= 4 and "rewards/episode/mean" in logged
    with pytest.raises(ConfigError, match="agent: an agent's episodes are the rollout; give agent or rollout_func"):
        GRPOTrainer(model=ASSET, args=config(tmp_path, agent="test_episodes:calculator_episode",
                                             rollout_func="test_episodes:calculator_episode"),
                    train_dataset=problems())


def test_agent_kwargs_set_the_episodes_from_a_config_and_bad_ones_are_named(tmp_path):
    """A recipe's `agent_kwargs` are the settings of its agent's Episodes: here its episodes run in a worker process
    (processes 1) with a deadline of 60 s; a setting Episodes lacks, and agent_kwargs without an agent, are refused
    by name."""
    args = config(tmp_path, task="calculator", agent="test_episodes:calculator_episode",
                  agent_kwargs='{"processes": 1, "timeout_s": 60}')
    trainer = GRPOTrainer(model=ASSET, args=args)
    episodes = trainer.agents.rollout_func
    assert (episodes.processes, episodes.timeout_s) == (1, 60.0)
    batch = trainer.rollout()
    workers = [w.pid for w in trainer.rollouts.agent.workers.workers]
    assert len(workers) == 1 and os.getpid() not in workers
    assert batch.metrics["episodes/model_calls"] >= 4
    trainer.rollouts.agent.workers.close()
    with pytest.raises(ConfigError, match="agent_kwargs: 'workers' is not a setting of an agent's episodes; they "
                                          "are timeout_s, host, port, token, window_s, client_kwargs, processes"):
        GRPOTrainer(model=ASSET, args=config(tmp_path, task="calculator", agent="test_episodes:calculator_episode",
                                             agent_kwargs={"workers": 2}))
    with pytest.raises(ConfigError, match="agent_kwargs: settings of an agent's episodes; name the episode function"):
        GRPOTrainer(model=ASSET, args=config(tmp_path, task="calculator", agent_kwargs={"processes": 2}))


@pytest.mark.slow  # (two training runs, one of two processes: 35 s on an idle machine, 3 min on a loaded one)
@pytest.mark.parametrize("processes", [0, 1])
def test_an_agent_on_two_processes_matches_one(tmp_path, processes):
    """DDP (2 processes, gloo): each process serves its own endpoint and runs the episodes of its rows (seeds belong
    to rows), rewards are gathered before the groups' statistics: the two processes' run is the one process's,
    rewards and lengths equal, weights within 1e-4 (adam_epsilon 1e-4: test_distributed's tool run says why). The
    calculator agent's calls extend one another (one row an episode); extra rows on several processes are an error
    (grpo.agents.episodes.one_row_each). processes 1: each DDP process forks its own episode worker."""
    from test_distributed import TOOLS_RECIPE, two_match_one

    tools = 'reward_funcs: ["math_accuracy", "rewards_for_tests:called_a_tool"]\n'
    assert tools in TOOLS_RECIPE  # (the tool run's recipe, the agent in place of the loop's tools and rewards)
    recipe = TOOLS_RECIPE.replace(tools, f"agent: test_episodes:tool_calling_episode\n"
                                         f"agent_kwargs: {{{{processes: {processes}}}}}\n")
    logs = two_match_one(tmp_path, recipe, ["reward/total", "completion/mean_length"])
    assert len(logs[0]) == 2 and all(row["train/grad_norm"] > 0 for row in logs[0])


# ---- episodes in processes of their own (Episodes(processes=N), grpo.agents.processes) ----------------------------
def episode_index(client) -> int:
    """The episode's number: its key e<k> in its base_url (episodes open in row order, numbered across rollouts)."""
    return int(str(client.base_url).split("/episodes/e")[1].split("/")[0])


def test_episodes_in_worker_processes_sample_what_the_trainers_process_does(tmp_path):
    """processes 1 and 2: the same trajectories (ids, masks, the engine's log-probs, rewards, advantages) as
    processes 0, on two rollouts of the same seeds, a sync agent; the workers persist across rollouts."""
    def run(n: int):
        episodes = Episodes(calculator_agent(), processes=n)
        trainer = GRPOTrainer(model=ASSET, args=config(tmp_path / str(n), num_generations=4), train_dataset=problems(),
                              reward_funcs=[], rollout_func=episodes)
        first = trainer.rollout()
        pids = [w.pid for w in trainer.rollouts.agent.workers.workers] if n else []
        second = trainer.rollout()
        if n:
            assert [w.pid for w in trainer.rollouts.agent.workers.workers] == pids and len(set(pids)) == n
            assert os.getpid() not in pids
        return first, second

    want = run(0)
    for n in (1, 2):
        for batch, base in zip(run(n), want):
            for name in ("input_ids", "attention_mask", "completion_mask", "sampling_logp", "advantages"):
                assert torch.equal(getattr(batch, name), getattr(base, name)), (n, name)
            assert [s["reward"] for s in batch.samples] == [s["reward"] for s in base.samples]
            assert batch.metrics["episodes/model_calls"] == base.metrics["episodes/model_calls"] >= 8
            assert batch.metrics["episodes/worker_died"] == 0


def _refuse():
    raise RuntimeError("this value cannot be loaded here")


class Unloadable:
    """Pickles, but raises when unpickled (as an object of a class the trainer's process cannot import)."""

    def __reduce__(self):
        return _refuse, ()


@pytest.mark.parametrize("processes", [0, 2])
def test_faults_inside_worker_processes_are_counted_as_in_the_trainers(tmp_path, processes):
    """Of five episodes: one raises, one overruns its deadline, one never calls the model, one returns a value that
    cannot be pickled (a lock), one a value that cannot be unpickled; neither value is a number, so both are
    bad_return on both sides."""
    import threading

    def episode(client, row):
        kind = ["raise", "slow", "silent", "lock", "unloadable"][episode_index(client) % 5]
        if kind != "silent":
            client.chat.completions.create(model="policy", messages=messages(row), max_tokens=3)
        if kind == "raise":
            raise ValueError("the agent's own bug")
        if kind == "slow":
            time.sleep(5)
        return threading.Lock() if kind == "lock" else Unloadable() if kind == "unloadable" else 1.0

    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path, num_generations=5, prompts_per_step=1),
                          train_dataset=problems(), reward_funcs=[],
                          rollout_func=Episodes(episode, timeout_s=1.0, processes=processes))
    batch = trainer.rollout()
    assert {k: batch.metrics[f"episodes/{k}"] for k in ("raised", "timeout", "no_calls", "bad_return", "worker_died")} \
        == {"raised": 1.0, "timeout": 1.0, "no_calls": 1.0, "bad_return": 2.0, "worker_died": 0.0}
    assert batch.completion_mask.sum() == 0 and batch.advantages.abs().sum() == 0


def test_a_worker_killed_mid_step_counts_its_unfinished_episodes_and_the_next_step_gets_a_new_one(tmp_path):
    """processes 2, four episodes: worker 0 runs e0 and e2, worker 1 e1 and e3. In the first rollout e1 kills its
    own process after its call while e3 waits (it could not end for 120 s): both are worker_died, e0 and e2 train.
    The second rollout (e4..e7) runs whole, worker 1 forked again, worker 0 the same process; worker 0 killed
    between rollouts, the third runs whole too."""
    import signal
    import threading

    def episode(client, row):
        client.chat.completions.create(model="policy", messages=messages(row), max_tokens=3)
        if episode_index(client) == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if episode_index(client) == 3:
            threading.Event().wait(120)
        return float(episode_index(client) % 2)

    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path, num_generations=4, prompts_per_step=1),
                          train_dataset=problems(), reward_funcs=[],
                          rollout_func=Episodes(episode, timeout_s=300, processes=2))
    batch = trainer.rollout()
    workers = trainer.rollouts.agent.workers.workers
    assert batch.metrics["episodes/worker_died"] == 2 and batch.metrics["episodes/model_calls"] == 4
    assert workers[1] is None and workers[0] is not None
    pid = workers[0].pid
    assert (batch.completion_mask.sum(1) > 0).tolist() == [True, False, True, False]  # (e1, e3 train nothing)
    again = trainer.rollout()
    assert again.metrics["episodes/worker_died"] == 0 and again.metrics["episodes/model_calls"] == 4
    assert (again.completion_mask.sum(1) > 0).all() and workers[0].pid == pid and workers[1].pid != pid
    # A worker that dies between rollouts (the OOM killer, say) is forked again before the next one.
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)  # (dead before the rollout: the signal's delivery is not the kill's return)
    third = trainer.rollout()
    assert third.metrics["episodes/worker_died"] == 0 and (third.completion_mask.sum(1) > 0).all()
    assert workers[0].pid != pid


def test_an_episode_using_cuda_in_a_forked_worker_stops_the_run_saying_so(tmp_path):
    """torch's refusal in a fork of a process that initialised CUDA (its message, raised as torch raises it) is not
    an episode's fault to count: the run stops, naming the cause and what to do."""
    def episode(client, row):
        client.chat.completions.create(model="policy", messages=messages(row), max_tokens=3)
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you "
                           "must use the 'spawn' start method")

    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path), train_dataset=problems(), reward_funcs=[],
                          rollout_func=Episodes(episode, processes=1))
    with pytest.raises(RuntimeError, match="^Episodes: an episode used CUDA in its worker process.*processes=0"):
        trainer.rollout()
    with pytest.raises(ConfigError, match="^Episodes: processes must be an integer >= 0"):
        Episodes(episode, processes=-1)


def test_episodes_in_a_worker_process_under_a_lag_train_what_the_trainers_process_does(tmp_path):
    """max_staleness 1: the rollout worker serves the endpoint and forks the episodes' worker from itself; the
    batches trained are those of processes 0, rollout by rollout (window_s 30 s: see the test above)."""
    from test_async import recording

    async def episode(client, row):
        await client.chat.completions.create(model="policy", messages=messages(row), tools=TOOLS, max_tokens=24)
        return {"reward": float(episode_index(client) % 2 == 0), "parent": os.getppid()}

    batches = {}
    for n in (0, 1):
        trainer = GRPOTrainer(model=ASSET, args=config(tmp_path / str(n), max_staleness=1, max_steps=3, num_threads=1),
                              train_dataset=problems(16), reward_funcs=[],
                              rollout_func=Episodes(episode, processes=n, window_s=30.0))
        batches[n] = recording(trainer)[1]
        trainer.train()
    assert sorted(batches[1]) == sorted(batches[0]) == [0, 1, 2]
    for t, batch in batches[1].items():
        assert batch.metrics["episodes/model_calls"] == 4 and batch.metrics["episodes/worker_died"] == 0
        # (processes 0: the episodes ran in the rollout worker, this process's child; 1: in its child)
        assert batches[0][t].metrics["episode/parent"] == os.getpid() != batch.metrics["episode/parent"]
        for name in ("input_ids", "completion_mask", "sampling_logp", "advantages"):
            assert torch.equal(getattr(batch, name), getattr(batches[0][t], name)), (t, name)


def test_a_batch_waits_while_a_worker_process_is_busy_building_requests(tmp_path):
    """processes 1, two episodes: e0 asks at once; e1 works on the CPU for 6 windows first (in the worker, not in
    the trainer's process). The worker's CPU counts as busy, as the episodes' threads do in the trainer's process:
    the batch stays open and both requests are one engine call. Without the workers' clock it closed after a quiet
    window: [1, 1]."""
    def episode(client, row):
        if episode_index(client) == 1:
            end = time.monotonic() + 6 * 0.25
            while time.monotonic() < end:
                sum(range(1000))
        client.chat.completions.create(model="policy", messages=messages(row), max_tokens=3)
        return 1.0

    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path, prompts_per_step=1), train_dataset=problems(),
                          reward_funcs=[], rollout_func=Episodes(episode, window_s=0.25, processes=1))
    calls, generate = [], trainer.generator.generate

    def counted(prompt_ids, params, seeds):
        calls.append(len(prompt_ids))
        return generate(prompt_ids, params, seeds)

    trainer.generator.generate = counted
    batch = trainer.rollout()
    assert calls == [2] and batch.metrics["episodes/model_calls"] == 2


def test_a_worker_stuck_past_the_deadline_is_killed_and_its_episodes_count_as_timeouts(tmp_path, monkeypatch):
    """An async episode that blocks its event loop (time.sleep, not asyncio.sleep) cannot be stopped by its deadline
    inside its worker: the trainer stops waiting at the deadline plus MARGIN_S (1 s here), kills that worker and
    counts its episode as a timeout; the other worker's episode trains; the next rollout gets a new worker."""
    from grpo.agents import processes

    monkeypatch.setattr(processes, "MARGIN_S", 1.0)

    async def episode(client, row):
        await client.chat.completions.create(model="policy", messages=messages(row), max_tokens=3)
        if episode_index(client) == 0:
            time.sleep(120)
        return float(episode_index(client) % 2)

    trainer = GRPOTrainer(model=ASSET, args=config(tmp_path, prompts_per_step=1), train_dataset=problems(),
                          reward_funcs=[], rollout_func=Episodes(episode, timeout_s=1.0, processes=2))
    batch = trainer.rollout()
    workers = trainer.rollouts.agent.workers.workers
    assert batch.metrics["episodes/timeout"] == 1 and batch.metrics["episodes/worker_died"] == 0
    assert (batch.completion_mask.sum(1) > 0).tolist() == [False, True] and workers[0] is None
    again = trainer.rollout()
    assert again.metrics["episodes/timeout"] == 0 and (again.completion_mask.sum(1) > 0).all()
