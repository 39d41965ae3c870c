"""Routing replay (R3, grpo.engines.moe) through what carries a rollout between its sampling and its update: a
checkpoint taken inside a rollout and the resume from it, and the lag pipeline's rollout worker (max_staleness > 0),
whose queued rollouts a checkpoint keeps. The experts chosen in every training pass are the rollout's, and a run
killed and resumed reaches the uninterrupted run's weights bit for bit."""

from __future__ import annotations

import contextlib
import signal

import pytest
import torch
from safetensors.torch import load_file

from grpo.engines import moe
from grpo.training.checkpoint.files import load_trainer_state
from test_async import recording, trainer_for
from test_moe import tiny_moe
from test_resume import read_rows, run_driver
from conftest import build_char_tokenizer


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE (2 layers, 4 experts, top-2; test_moe.tiny_moe) with the byte tokenizer, saved."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    tok = build_char_tokenizer(path)
    tiny_moe("qwen3_moe", len(tok), pad=tok.pad_token_id, eos=tok.eos_token_id).save_pretrained(path)
    return str(path)


def settings(model_dir, out, **extra) -> dict:
    """test_resume's job on the MoE model, R3 on, a checkpoint every step."""
    return {**dict(model_name_or_path=model_dir, task=None, num_generations=4, prompts_per_step=2,
                   per_device_train_batch_size=4, max_completion_length=6, learning_rate=1e-2, beta=0.04,
                   max_steps=4, save_steps=1, save_total_limit=None, report_to=[], log_completions_steps=0, seed=0,
                   router_replay="R3", output_dir=str(out)), **extra}


def assert_resumes_exactly(cfg: dict, tmp_path, point: str, kill_step: int) -> None:
    """`cfg` run straight, then killed (-9) at `point` of step `kill_step` and resumed: the same weights bit for
    bit and the same logged rows, the routing mismatch included."""
    assert run_driver(cfg, tmp_path, "none", 0) == 0
    want = load_file(f"{cfg['output_dir']}/final/model.safetensors")
    again = {**cfg, "output_dir": str(tmp_path / "run")}
    assert run_driver(again, tmp_path, point, kill_step) == -signal.SIGKILL
    assert run_driver({**again, "resume": True}, tmp_path, "none", 0) == 0
    got = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert max((got[k] - want[k]).abs().max().item() for k in want) == 0.0
    keys = ("reward/total", "policy/loss", "train/grad_norm", "moe/routing_mismatch", "moe/aux_loss")
    ours, theirs = read_rows(tmp_path / "run"), read_rows(tmp_path / "straight")
    assert [[r.get(k) for k in keys] for r in ours] == [[r.get(k) for k in keys] for r in theirs]
    assert all("moe/routing_mismatch" in r for r in theirs)


def test_kill_inside_a_rollout_and_resume_replays_the_kept_routes(moe_dir, tmp_path):
    """num_iterations 2: the checkpoint of step 1 is taken inside rollout 0 and keeps its rows, their routes with
    them; a kill -9 in step 2 and a resume train step 2 under the same replayed experts (without the routes the
    resumed step would route by itself: its update differs, measured). The second step of each rollout routes some
    tokens otherwise (its weights moved) and replay overrides them."""
    cfg = settings(moe_dir, tmp_path / "straight", num_iterations=2)
    assert_resumes_exactly(cfg, tmp_path, "micro_step", 2)
    pending = load_trainer_state(tmp_path / "straight" / "checkpoint-1")["processes"][0]["pending"]["batch"]
    routes = pending["routes"]
    assert routes.dtype == torch.uint8 and routes.shape[:2] == pending["input_ids"].shape
    assert routes.shape[2:] == (2, 2)  # (layers, top-k)
    assert (routes[pending["attention_mask"].bool()] != moe.NOT_ROUTED).any()
    assert max(r["moe/routing_mismatch"] for r in read_rows(tmp_path / "straight")) > 0


# (CI time: the kill test above checkpoints kept routes; test_r3_through_the_lag_pipeline carries them
# through the worker)
@pytest.mark.slow
def test_kill_mid_pipeline_and_resume_with_routes_in_flight(moe_dir, tmp_path):
    """max_staleness 1: the rollout worker records the routes; the checkpoint of step 3 holds rollout 4 generated
    ahead, its routes with it; a kill -9 in step 4 and a resume reach the uninterrupted run's weights bit for bit."""
    cfg = settings(moe_dir, tmp_path / "straight", max_staleness=1, max_steps=5)
    assert_resumes_exactly(cfg, tmp_path, "micro_step", 4)
    kept = load_trainer_state(tmp_path / "straight" / "checkpoint-3")["processes"][0]["pipeline"]
    assert set(kept["ready"]) == {3}  # (rollout 4, of step 3's own weights, kept as a recipe)
    fields = kept["ready"][3][0]
    assert [r.shape for r in fields["routes"]] == [(len(p) + len(c), 2, 2) for p, c in
                                                   zip(fields["prompt_ids"], fields["completion_ids"])]


@contextlib.contextmanager
def first_outputs(modules, pick):
    """While open: {i: pick(args, output) of modules[i]'s first forward} (the pass's, not backward's recomputation;
    a hook returning None keeps the output)."""
    seen = {}

    def keep(i):
        def hook(module, args, out):
            seen.setdefault(i, pick(args, out).clone())
        return hook

    handles = [m.register_forward_hook(keep(i)) for i, m in enumerate(modules)]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def watched_passes(trainer):
    """Every update and scoring pass in the trainer's process checked: the experts each layer ran for each token
    the rollout routed are the rollout's. Yields the list of (pass kind, tokens checked)."""
    routing, policy, checked = trainer.updates.routing, trainer.policy, []
    real_update, real_score = routing.update_pass, routing.score_pass

    @contextlib.contextmanager
    def watch(kind, inner, model, micro):
        with first_outputs([layer.mlp.experts for layer in model.model.layers], lambda args, out: args[1]) as seen:
            with inner:
                yield inner
        known = (micro.routes != moe.NOT_ROUTED).all(-1).all(-1)
        assert known.any() and sorted(seen) == list(range(len(model.model.layers)))
        for layer, experts in seen.items():
            want = micro.routes[known, layer].long().sort(-1).values
            assert torch.equal(experts[known].sort(-1).values, want), (kind, layer)
        checked.append((kind, int(known.sum())))

    routing.update_pass = lambda backend, model, micro, share: watch(
        "update", real_update(backend, model, micro, share), policy, micro)
    routing.score_pass = lambda model, micro: watch("score", real_score(model, micro), model, micro)
    yield checked
    routing.update_pass, routing.score_pass = real_update, real_score


@pytest.mark.parametrize("mu", [1, 2])
def test_r3_through_the_lag_pipeline(moe_dir, tmp_path, mu):
    """max_staleness 1 with R3: rollout t is sampled by the worker with the weights of rollout t - 1, and its routes
    are those weights' routing (a pass under them, R3 off, routes every recorded token as the rollout did), not the
    weights the update runs with (some tokens route otherwise there); every update and scoring pass runs each token
    under the rollout's experts; the worker's reference log-probs are the trainer's own replayed pass's."""
    trainer = trainer_for(moe_dir, tmp_path / "run", max_staleness=1, num_iterations=mu, router_replay="R3",
                          num_threads=1)
    snapshots, batches = recording(trainer)
    with watched_passes(trainer) as checked:
        trainer.train()
    assert "update" in {kind for kind, _ in checked} and sum(n for _, n in checked) > 0
    rows = read_rows(tmp_path / "run")
    assert all("moe/routing_mismatch" in r for r in rows)
    trainer.backend.prepare()
    routing, steps = trainer.updates.routing, trainer.layout.rollout_steps
    moved = unreplayed = 0
    for t, batch in batches.items():
        assert batch.routes is not None and batch.metrics["pipeline/weight_version"] == max(0, t - 1) * steps
        assert mismatch(trainer, snapshots[max(0, t - 1)], batch) == 0.0  # (the weights it was sampled with)
        moved += mismatch(trainer, snapshots[t], batch) > 0  # (the weights its update starts from)
        # the worker replayed the routes in its reference pass: the trainer's replayed pass, and not a plain one
        assert torch.equal(batch.ref_logp, trainer._reference_logprobs(batch).cpu())
        routing.replay = False
        unreplayed += not torch.equal(batch.ref_logp, trainer._reference_logprobs(batch).cpu())
        routing.replay = True
    assert moved >= 1 and unreplayed >= 1
    # (the routing weights' gradient reaches the routers: they moved)
    first = snapshots[0]
    assert all(not torch.equal(first[n], p) for n, p in trainer.policy.named_parameters() if "mlp.gate" in n)


def mismatch(trainer, weights: dict, batch) -> float:
    """The share of the batch's routed tokens that `weights`, routing by themselves, send to other experts than
    the rollout's routes in some layer (every micro-batch of the first pass)."""
    trainer.policy.load_state_dict(weights)
    routed = differ = 0
    with torch.no_grad():
        for step in trainer.updates.plan(batch):
            for plan in step.micro_batches if step.iteration == 0 else ():
                micro = plan.inputs(batch, trainer.accel.device)
                with moe.RoutingPass(trainer.policy, micro.routes, False, False) as hooks:
                    trainer.backend.logprobs(trainer.policy, micro.input_ids, micro.attention_mask, micro.width, 1.0,
                                             micro.packed)
                stats = hooks.stats(lambda tokens: None)
                routed, differ = routed + int(stats.routed), differ + int(stats.mismatched)
    return differ / routed


def test_r3_under_sequence_parallelism_replays_each_slice(tmp_path):
    """SP=2 (tests/moe_sp_driver.py, 2 gloo processes): a packed row of 59 tokens split 30 + 29 (the second slice
    padded by one position); with the routers perturbed after the rollout, every token of each process's slice
    runs, in every layer, on its rollout experts; the log-probs, the load-balancing loss (each process's, from the
    router logits gathered over the group) and the group's summed gradients of the loss plus 0.5 x the aux loss are
    the one-process replayed pass's (float32 summation order only: test_sequence_parallel measured <= 6.1e-7
    relative; with each slice's own aux loss instead, the gradients were off by 2.5x relative), the routers get gradient, and
    moe/routing_mismatch summed over the group is the one-process count."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_distributed import free_port

    here = Path(__file__).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(free_port()), str(here / "moe_sp_driver.py"), str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["tokens"] for r in ranks] == [59, 59] and [r["slice"] for r in ranks] == [30, 30]
    assert [r["checked"] for r in ranks] == [30, 29]  # (the padding position is no rollout token)
    for r in ranks:
        assert r["same_experts"]
        assert r["logp"] < 1e-5 and r["aux"] < 1e-5 and max(r["grads"].values()) < 1e-5, r
        assert r["router_grad"] > 0
        assert r["mismatch_sp"] == r["mismatch_one"] and 0 < r["mismatch_one"] < 1


@pytest.mark.slow  # (two grpo train runs, one on 2 processes: minutes; the SP replay itself is checked above)
def test_training_with_r3_under_sequence_parallelism_matches_one_process(moe_dir, tmp_path):
    """`grpo train` with R3 and two optimizer steps per rollout, on 2 gloo processes with sequence_parallel_size=2
    (every packed micro-batch split over both) and on one process: the same rewards, gradient norms, loss metrics,
    load-balancing loss (the model's default weight, 0.001) and weights, as test_distributed.assert_same_run asks
    of a data-parallel run (float32 summation order only; a rollout's second step logs no rewards). With each
    process's aux loss of its own slice, the first step's gradient norm was off by 3e-4 relative and the weights by
    4e-2. The routing mismatch is 0 on each rollout's first step and above 0 on its second in both, not the same
    share: one process packs each prompt once per group, sequence parallelism once per row, so the prompt tokens
    weigh differently in it (test_r3_under_sequence_parallelism_replays_each_slice compares the counts on one
    layout)."""
    import json

    from test_distributed import free_port, job, run

    env = job(tmp_path, moe_dir)
    over = ["router_replay=R3", "num_iterations=2", "max_completion_length=24"]
    run(["-m", "grpo.cli"], tmp_path / "one", env, overrides=over)
    run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "grpo.cli"],
        tmp_path / "sp", env, overrides=[*over, "sequence_parallel_size=2"])
    one, sp = ([json.loads(r) for r in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("one", "sp"))
    assert [r.get("reward/total") for r in one] == [r.get("reward/total") for r in sp]
    for rows in (one, sp):  # (the second step of a rollout: its weights moved)
        assert [r["moe/routing_mismatch"] > 0 for r in rows] == [False, True, False]
    for a, b in zip(one, sp):
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
        for key in ("policy/kl_divergence", "train/loss", "moe/aux_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (key, a[key], b[key])
    a, b = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("one", "sp"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 5e-4
