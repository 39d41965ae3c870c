"""An agent's episodes through the endpoint when a `grpo vllm-serve` server generates (use_vllm, vllm_mode: server):
the endpoint serves from the server's engine, so the token ids and log-probs trained on are vLLM's; with a lag
(max_staleness 1) every call is pinned to the weights of rollout t - 1 (grpo.training.rollout.pipeline_server gives
the rollout's copy a pinned engine, and the episodes' copy an endpoint of its own over it).

Skipped where vLLM is not importable: `bash scripts/vllm_env.sh`, then `.venv-vllm/bin/python -m pytest -q
tests/test_vllm_episodes.py` (one server start, about a minute, for both tests).
"""

from __future__ import annotations

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from test_async import recording, version_gaps
from test_resume import read_rows
from test_vllm import needs_vllm
from test_vllm_async import settings
from test_vllm_server import serving
from test_vllm_training import VLLM

openai = pytest.importorskip("openai")

from grpo.agents import Episodes  # noqa: E402
from test_episodes import ASSET, TOOLS, messages, problems  # noqa: E402


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    with serving(ASSET, tmp_path_factory.mktemp("vllm-episodes") / "server.log") as port:
        yield ASSET, port


async def episode(client, row):
    """Two calls, the second not extending the first (an extra row); rewards 1, 0 within each group of two."""
    await client.chat.completions.create(model="policy", messages=messages(row), tools=TOOLS, max_tokens=24)
    await client.chat.completions.create(model="policy", messages=messages(row) + [
        {"role": "user", "content": "Again."}], tools=TOOLS, max_tokens=24)
    return float(int(str(client.base_url).split("/episodes/e")[1].split("/")[0]) % 2 == 0)


def config(server, out, **extra) -> GRPOConfig:
    return GRPOConfig(**{**settings(server, out, vllm_weight_transfer="http", **extra), "task": None,
                         "num_generations": 2, "prompts_per_step": 2, "per_device_train_batch_size": 4,
                         "max_completion_length": 64, "learning_rate": 1e-2, "beta": 0.0, "seed": 3})


@needs_vllm
def test_an_agent_trains_through_the_endpoint_on_a_vllm_server(tools_server, tmp_path):
    """The rows trained are the ids vLLM sampled, with vLLM's log-probs: within 2e-3 of the update pass's (the
    float32 tolerance test_vllm_async holds the server to), on every trained token, extra rows included."""
    seen = []

    async def recorded(client, row):
        seen.append(str(client.base_url))
        return await episode(client, row)

    trainer = GRPOTrainer(model=ASSET, args=config(tools_server, tmp_path / "run", max_steps=1),
                          train_dataset=problems(), reward_funcs=[], rollout_func=Episodes(recorded))
    trains_on_vllms_rows(trainer)
    assert len(seen) == 8  # (4 episodes in the rollout checked, 4 in the training step's)


@needs_vllm
def test_an_agent_trains_through_the_endpoint_on_a_colocated_vllm_engine(tmp_path):
    """use_vllm with vllm_mode colocate: the endpoint's engine thread calls the trainer's own vLLM engine (not the
    thread that made it); the rows trained are vLLM's, as on the server."""
    args = GRPOConfig(output_dir=str(tmp_path / "run"), task=None, num_generations=2, prompts_per_step=2,
                      per_device_train_batch_size=4, max_completion_length=64, learning_rate=1e-2, beta=0.0, seed=3,
                      max_steps=1, save_steps=0, report_to=[], log_completions_steps=0, vllm_mode="colocate", **VLLM)
    trainer = GRPOTrainer(model=ASSET, args=args, train_dataset=problems(), reward_funcs=[],
                          rollout_func=Episodes(episode))
    assert type(trainer.generator).__name__ == "VLLMEngine"
    trains_on_vllms_rows(trainer)


def trains_on_vllms_rows(trainer) -> None:
    """One rollout of `episode`'s 4 episodes (8 calls, 8 rows): the trained ids are the engine's, its log-probs
    within 2e-3 of the update pass's (the float32 tolerance test_vllm_async holds vLLM to) on every trained
    token, extra rows included; then a training step."""
    batch = trainer.rollout()
    assert batch.input_ids.shape[0] == 8 and batch.metrics["episodes/model_calls"] == 8
    mask = batch.completion_mask.bool()
    update = trainer.updates.score(trainer.policy, batch).cpu()
    assert mask.sum() > 0 and torch.allclose(update[mask], batch.sampling_logp[mask], atol=2e-3, rtol=0)
    trainer.train()
    assert trainer.step == 1


@needs_vllm
def test_an_agent_with_a_lag_on_a_vllm_server_is_served_the_weights_of_rollout_t_minus_1(tools_server, tmp_path):
    trainer = GRPOTrainer(model=ASSET, args=config(tools_server, tmp_path / "run", max_staleness=1, max_steps=3),
                          train_dataset=problems(), reward_funcs=[], rollout_func=Episodes(episode))
    snapshots, batches = recording(trainer)
    trainer.train()
    rows = read_rows(tmp_path / "run")
    assert [r["pipeline/weight_version"] for r in rows] == [0, 0, 1]
    assert [r["episodes/model_calls"] for r in rows] == [8, 8, 8]
    trainer.backend.prepare()
    told_apart = 0
    for t, batch in batches.items():
        gaps, moved = version_gaps(trainer, snapshots, batch, max(0, t - 1))
        assert gaps[max(0, t - 1)] < 2e-3, (t, gaps)
        assert all(gaps[v] > 1e-2 for v in moved), (t, gaps)
        told_apart += len(moved)
    assert told_apart >= 1
