"""Asynchronous rollouts with a fixed lag (max_staleness; grpo.training.rollout.pipeline, docs/async.md).

lag 0 is today's run (no worker); each rollout's weights are exactly those of `lag` rollouts before (checked through
the log-probs the worker sampled with, not only the version it reports); a run killed mid-pipeline resumes to the
uninterrupted run's weights bit for bit; the decoupled objective against numbers derived by hand.
"""

from __future__ import annotations

import math
import signal

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from grpo.training.checkpoint.files import load_trainer_state
from grpo.core import LossSettings, engine_importance_weights, policy_loss
from grpo.training.update.objective import MicroInputs, Objective
from grpo.training.rollout.pipeline import LaggedRollouts
from grpo.training.rollout.sources import SyncRollouts
from rewards_for_tests import count_a
from test_resume import read_rows, run_driver

LN = math.log


def settings(model_dir, out, **extra) -> dict:
    return {**dict(model_name_or_path=model_dir, task=None, num_generations=4, prompts_per_step=2,
                   per_device_train_batch_size=4, max_completion_length=6, learning_rate=1e-2, beta=0.04,
                   max_steps=6, save_steps=100, report_to=[], log_completions_steps=0, seed=0, output_dir=str(out)),
            **extra}


def trainer_for(model_dir, out, **extra) -> GRPOTrainer:
    data = Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]})
    return GRPOTrainer(reward_funcs=[count_a], args=GRPOConfig(**settings(model_dir, out, **extra)),
                       train_dataset=data)


# ---- the decoupled objective (pure math) -------------------------------------------------------------------------
def test_decoupled_objective_by_hand():
    """One row of 2 tokens, A = +1, eps 0.2, the behaviour weight token-truncated at 1.5, beta 0, sequence mean.
    pi_theta / pi_prox = [1.5, 0.9] -> clipped [1.2, 0.9]; surrogate -min(rho A, clip A) = [-1.2, -0.9].
    pi_prox / pi_behav = [2, 0.25] -> truncated weights [1.5, 0.25]; weighted [-1.8, -0.225]; loss -2.025 / 2 =
    -1.0125. Gradient: token 0 is clipped (rho 1.5 > 1.2 with A > 0), 0; token 1: -w rho A / 2 = -0.1125.
    Clipping against the behaviour policy instead (pi_theta / pi_behav = [3, 0.225]) would give other numbers: the
    clip sits around the proximal policy."""
    behav = torch.tensor([[-1.0, -2.0]])
    prox = behav + torch.tensor([[LN(2), LN(0.25)]])
    logp = (prox + torch.tensor([[LN(1.5), LN(0.9)]])).requires_grad_(True)
    mask = torch.ones(1, 2)
    weights, metrics = engine_importance_weights(prox, behav, mask, mode="token_truncate", clip_max=1.5)
    assert weights[0].tolist() == pytest.approx([1.5, 0.25])
    assert metrics["ratio_mean"].item() == pytest.approx(1.125) and metrics["bounded_frac"].item() == 0.5
    out = policy_loss(logp, prox, torch.tensor([1.0]), mask, LossSettings(eps_low=0.2, eps_high=0.2),
                      sampling_weights=weights)
    assert out.loss.item() == pytest.approx(-1.0125, abs=1e-6)
    out.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.1125], abs=1e-6)


class _OneProcess:
    world = 1


@pytest.mark.parametrize("lag, weighted", [(0, False), (2, True)])
def test_objective_weights_stale_rows_only_with_a_lag(lag, weighted):
    """Sampling log-probs 0.5 nats below pi_old on every token: with a lag each token weighs e^0.5 = 1.6487
    (sequence_mask's cap 3 over a row of one token); at lag 0 without vLLM they are not a behaviour policy (the
    CPU engine's own log-probs of the same weights) and weigh 1. Surrogate at rho = 1, A = 1: -1 per token."""
    cfg = GRPOConfig(max_staleness=lag, beta=0.0)
    logp = torch.tensor([[-1.0]])
    micro = MicroInputs(torch.ones(1, 1), torch.tensor([1.0]), None, logp - 0.5, None, 1.0, 1)
    out = Objective(cfg, _OneProcess()).loss(logp, None, micro)
    assert out.loss.item() == pytest.approx(-math.exp(0.5) if weighted else -1.0, abs=1e-6)
    assert ("sampling/importance_ratio_mean" in out.metrics) == weighted


# ---- settings -----------------------------------------------------------------------------------------------------
def test_aliases_and_refusals_are_named():
    assert GRPOConfig(max_async_level=2).max_staleness == 2  # prime-rl's name
    assert GRPOConfig(max_trajectory_age_steps=1).max_staleness == 1  # NeMo-RL's
    with pytest.raises(ConfigError, match="max_staleness: must be >= 0"):
        GRPOConfig(max_staleness=-1)
    assert GRPOConfig(max_staleness=1, dynamic_sampling=True).dynamic_sampling  # (the worker draws the prompts)
    with pytest.raises(ConfigError, match="max_staleness: multi-turn rollouts .* run on the vLLM server path"):
        GRPOConfig(max_staleness=1, tools=["calculator"])
    with pytest.raises(ConfigError, match="max_staleness: a rollout_func is handed the trainer itself"):
        GRPOConfig(max_staleness=1, rollout_func="rewards_for_tests:count_a", use_vllm=True, vllm_mode="server")
    assert GRPOConfig(max_staleness=1, tools=["calculator"], use_vllm=True, vllm_mode="server").tools


# ---- the pipeline on the tiny model -------------------------------------------------------------------------------
def test_lag_zero_is_the_synchronous_run(tiny_model_dir, tmp_path):
    """No worker at lag 0, and the weights of an explicit max_staleness: 0 equal the default run's; a lag changes
    them (the rollouts come from older weights)."""
    finals = {}
    for name, extra in (("default", {}), ("zero", {"max_staleness": 0}), ("one", {"max_staleness": 1})):
        trainer = trainer_for(tiny_model_dir, tmp_path / name, **extra)
        assert isinstance(trainer.source, SyncRollouts if name != "one" else LaggedRollouts)
        trainer.train()
        finals[name] = load_file(str(tmp_path / name / "final" / "model.safetensors"))
    assert all(torch.equal(finals["default"][k], finals["zero"][k]) for k in finals["default"])
    assert any(not torch.equal(finals["default"][k], finals["one"][k]) for k in finals["default"])


@pytest.mark.parametrize("lag, mu, engine, extra", [
    (1, 1, "cpu", {}), (2, 1, "cpu", {}), (1, 2, "cpu", {}), (1, 1, "transformers", {}),
    (1, 1, "cpu", {"steps_per_generation": 4, "prompts_per_step": None, "gradient_accumulation_steps": 2}),
])
def test_each_rollout_is_sampled_with_the_weights_lag_rollouts_before(tiny_model_dir, tmp_path, lag, mu, engine,
                                                                      extra):
    """Rollout t's sampling log-probs (the worker's, under the weights it had) equal the log-probs of its tokens
    under the trainer's weights at rollout max(0, t - lag), and not under the next or previous version; with the CPU
    engine and the transformers engine, several passes over a rollout (mu 2) and several optimizer steps per pass."""
    # (one torch thread, as the worker has: the two processes' reference passes then sum in the same order)
    trainer = trainer_for(tiny_model_dir, tmp_path / "run", max_staleness=lag, num_iterations=mu, engine=engine,
                          num_threads=1, **extra)
    snapshots, batches = recording(trainer)
    trainer.train()
    steps = trainer.layout.rollout_steps
    assert steps == mu * (2 if extra else 1)
    rows = read_rows(tmp_path / "run")
    trainer.backend.prepare()  # (the passes as the run took them: train() released the engine's changes)
    told_apart = 0  # rollouts whose neighbouring versions' weights differ, and were told apart
    for t, batch in batches.items():
        want = max(0, t - lag)
        assert batch.metrics["pipeline/weight_version"] == want * steps
        assert rows[t * steps]["pipeline/staleness"] == (t - want) * steps
        gaps, moved = version_gaps(trainer, snapshots, batch, want)
        assert gaps[want] < 1e-4, (t, gaps)
        # the worker took the reference's log-probs too (beta 0.04): the numbers the trainer's process would take
        assert torch.equal(batch.ref_logp, trainer._reference_logprobs(batch).cpu())
        assert all(gaps[v] > 1e-3 for v in moved), (t, gaps)  # (a step with no gradient leaves the weights)
        told_apart += len(moved)
    assert told_apart >= len(batches) // 2


def recording(trainer) -> tuple[dict, dict]:
    """(weights, batch) by rollout index, filled as the run takes each rollout: the policy's weights at that moment
    and the batch."""
    snapshots, batches, real_next = {}, {}, trainer.source.next

    def recording_next(index):
        snapshots[index] = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
        batches[index] = real_next(index)
        return batches[index]

    trainer.source.next = recording_next
    return snapshots, batches


def version_gaps(trainer, snapshots: dict, batch, want: int) -> tuple[dict[int, float], set[int]]:
    """Per version v in want - 1 .. want + 1: the largest gap between the batch's sampling log-probs and its tokens'
    log-probs under the weights taken at rollout v; and the versions whose weights differ from want's."""
    gaps = {}
    for version in {want - 1, want, want + 1} & set(snapshots):
        trainer.policy.load_state_dict(snapshots[version])
        logp = trainer.updates.score(trainer.policy, batch).cpu()
        gaps[version] = float(((logp - batch.sampling_logp) * batch.completion_mask).abs().max())
    moved = {v for v in gaps if any(not torch.equal(snapshots[v][k], w) for k, w in snapshots[want].items())}
    return gaps, moved


@pytest.mark.parametrize("lag, point, kill_step, mu", [
    (2, "save", 3, 1), (1, "micro_step", 4, 2),
    pytest.param(1, "micro_step", 3, 1, marks=pytest.mark.slow),  # (lag 1 mid-update: the mu 2 case kills there too)
    pytest.param(2, "micro_step", 4, 1, marks=pytest.mark.slow)])
def test_kill_mid_pipeline_and_resume_matches_uninterrupted(tiny_model_dir, tmp_path, lag, point, kill_step, mu):
    """Checkpoints every step hold the rollouts generated ahead; a kill -9 and a resume reach the uninterrupted
    async run's weights bit for bit, with the same logged rows. With mu 2 the checkpoint of step 3 falls inside
    rollout 1 (steps 3 and 4), with rollout 2 generated ahead."""
    cfg = settings(tiny_model_dir, tmp_path / "straight", max_staleness=lag, save_steps=1, save_total_limit=None,
                   num_iterations=mu)
    assert run_driver(cfg, tmp_path, "none", 0) == 0
    want = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    # Step 3's checkpoint kept the rollouts asked for and not trained on (from ceil(3 / mu) to floor(3 / mu) + lag):
    # those of older weights generated, the one of its own weights (asked for at step 3 when mu is 1) as a recipe.
    kept = load_trainer_state(tmp_path / "straight" / "checkpoint-3")["processes"][0]["pipeline"]
    assert set(kept["ready"]) | set(kept["recipes"]) == set(range(-(-3 // mu), min(3 // mu + lag, 6 // mu - 1) + 1))
    assert list(kept["recipes"]) == ([3 + lag] if mu == 1 else [])
    cfg = {**cfg, "output_dir": str(tmp_path / "run")}
    assert run_driver(cfg, tmp_path, point, kill_step) == -signal.SIGKILL
    assert run_driver({**cfg, "resume": True}, tmp_path, "none", 0) == 0
    got = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert max((got[k] - want[k]).abs().max().item() for k in want) == 0.0
    keys = ("reward/total", "policy/loss", "train/grad_norm", "pipeline/weight_version",
            "sampling/importance_ratio_mean")
    ours, theirs = read_rows(tmp_path / "run"), read_rows(tmp_path / "straight")
    assert [r["step"] for r in ours] == [r["step"] for r in theirs]
    assert [[r.get(k) for k in keys] for r in ours] == [[r.get(k) for k in keys] for r in theirs]


def test_dynamic_sampling_with_a_lag_draws_in_the_worker_and_resumes_exactly(tiny_model_dir, tmp_path):
    """dynamic_sampling with lag 1: the worker draws each rollout's prompts, refills included, in rollout order
    (some rollout takes more than one round here: count_a's groups are often all 0), with the weights of step
    t - 1; a kill -9 mid-pipeline and a resume reach the uninterrupted run's weights bit for bit, with the same rows
    (the checkpoint holds the prompt stream where the worker's was after the last rollout it generated; the resumed
    worker draws the rollout kept as a recipe again from there)."""
    cfg = settings(tiny_model_dir, tmp_path / "straight", max_staleness=1, save_steps=1, save_total_limit=None,
                   dynamic_sampling=True, max_generation_rounds=3)
    assert run_driver(cfg, tmp_path, "none", 0) == 0
    want_rows = read_rows(tmp_path / "straight")
    assert [r["pipeline/weight_version"] for r in want_rows] == [0, 0, 1, 2, 3, 4]
    assert max(r["sampling/generation_rounds"] for r in want_rows) > 1
    want = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    cfg = {**cfg, "output_dir": str(tmp_path / "run")}
    assert run_driver(cfg, tmp_path, "micro_step", 3) == -signal.SIGKILL
    assert run_driver({**cfg, "resume": True}, tmp_path, "none", 0) == 0
    got = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert max((got[k] - want[k]).abs().max().item() for k in want) == 0.0
    keys = ("reward/total", "policy/loss", "sampling/generation_rounds", "sampling/kept_groups",
            "pipeline/weight_version")
    assert [[r.get(k) for k in keys] for r in read_rows(tmp_path / "run")] == [[r.get(k) for k in keys]
                                                                                for r in want_rows]


def test_resume_with_another_lag_is_refused(tiny_model_dir, tmp_path):
    cfg = settings(tiny_model_dir, tmp_path / "run", max_staleness=1, save_steps=1, max_steps=4)
    assert run_driver(cfg, tmp_path, "micro_step", 3) == -signal.SIGKILL
    with pytest.raises(ConfigError, match="written with max_staleness: 1"):
        trainer_for(tiny_model_dir, tmp_path / "run", max_staleness=2, max_steps=4, resume=True).train()


def test_lora_sends_only_the_adapters(tiny_model_dir, tmp_path):
    """With LoRA the worker is sent only the trained adapters; they train, and the rollouts follow the lag."""
    trainer = trainer_for(tiny_model_dir, tmp_path / "run", max_staleness=1, use_peft=True, lora_r=4,
                          lora_target_modules=["q_proj", "v_proj"], learning_rate=5e-2)
    from grpo.training.rollout.pipeline import _trainable

    sent = _trainable(trainer.policy)
    assert sent and all("lora_" in name for name in sent)
    trainer.train()
    rows = read_rows(tmp_path / "run")
    assert [r["pipeline/weight_version"] for r in rows] == [0, 0, 1, 2, 3, 4]
    assert rows[-1]["pipeline/staleness"] == 1
    assert any(not torch.equal(value, sent[name]) for name, value in _trainable(trainer.policy).items())


def test_two_processes_with_a_lag_match_one(tmp_path, tiny_model_dir):
    """DDP (2 processes, gloo): each process's worker generates its share of the rows with the lagged weights; the
    run reaches the one-process lagged run's weights. Only the order of float32 sums differs (the gradient
    all-reduced over the processes vs accumulated over one's micro-batches), so with Adam linear in the gradient
    the two share rewards exactly and every step's gradient norm, loss metrics and weights to that rounding
    (test_distributed.assert_reordered_run). (With Adam's epsilon of 1e-8 a rounding difference in a near-zero
    gradient element became a step of up to lr, and the third step's gradient norms 1.3e-5 apart on one CPU.)"""
    from test_distributed import LINEAR_ADAM, RECIPE, assert_reordered_run, free_port, job, run

    env = job(tmp_path, tiny_model_dir)
    lag = ["max_staleness=1", *LINEAR_ADAM]
    run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "grpo.cli"],
        tmp_path / "two", env, overrides=lag)
    run(["-m", "grpo.cli"], tmp_path / "one", env, overrides=lag)
    one = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    # A gradient element sums over every token of the step: 32 rows (4 prompts x 8) of at most 4 prompt tokens
    # ("q15\n") and 8 completion tokens (RECIPE).
    assert "num_generations: 8\nprompts_per_step: 4" in RECIPE and "max_completion_length: 8" in RECIPE
    assert_reordered_run(tmp_path / "one", tmp_path / "two", one, two, terms=32 * (4 + 8), steps=3)
    rows = read_rows(tmp_path / "two")
    assert [r["pipeline/weight_version"] for r in rows] == [0, 0, 1]


def test_a_failing_worker_is_an_error_naming_the_rollout(tiny_model_dir, tmp_path):
    """An exception in the worker (here the engine's generate) reaches the trainer as an error with the rollout's
    index and the worker's traceback, instead of a trainer waiting forever."""
    trainer = trainer_for(tiny_model_dir, tmp_path / "run", max_staleness=1)

    def generate(*args, **kwargs):
        raise ValueError("the engine broke")

    trainer.generator.generate = generate  # (the worker is forked from this trainer: it inherits the patch)
    with pytest.raises(RuntimeError, match="(?s)rollout worker: rollout 0 failed.*the engine broke"):
        trainer.train()


def test_a_lag_after_cuda_started_is_refused(monkeypatch):
    """A CPU run on a GPU host whose process has started CUDA (a reward model put on cuda): the forked rollout worker,
    which runs the rewards, could not use CUDA after the fork (gpu_review2 N15); refused by name before forking."""
    import types

    from grpo.training.rollout.sources import make_source

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    rollouts = types.SimpleNamespace(agent=None, procs=types.SimpleNamespace(world=1))
    with pytest.raises(ConfigError, match=r"max_staleness: CUDA is initialised in the trainer's process \(a reward "
                                          r"model on cuda\?\).*set max_staleness: 0"):
        make_source(GRPOConfig(max_staleness=1), rollouts, None, torch.device("cpu"), 1, 4, "NO")
