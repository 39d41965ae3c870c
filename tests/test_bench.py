"""The benchmark (bench/): its FLOP formula, its summary arithmetic, its model files, and a miniature run.

The miniature run is CI's guard against the benchmark rotting: it runs `bench/run.py --workload mini` end to end
(the TRL side too when TRL is installed) and checks the JSON line, never a timing.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.flops import step_flops
from bench.model_files import build_tokenizer
from bench.run import order
from bench.summary import check_identical_work, requirements, summarize
from bench.workloads import WORKLOADS, Workload, prompts

# A model small enough to count by hand: H=4, 1 layer, 2 heads of size 2, 1 KV head, MLP 8, V=10; P=2, T=3, B=1, G=2.
SMALL = Workload(name="small", vocab=10, hidden=4, layers=1, heads=2, kv_heads=1, intermediate=8,
                 prompts_per_step=1, num_generations=2, completion_length=3, prompt_length=2, micro_batch=2)


def test_flops_full_finetuning_by_hand():
    # Linear weights of the layer: q 4x4=16, k 4x2=8, v 4x2=8, o 4x4=16, gate 4x8=32, up 4x8=32, down 8x4=32 -> 144.
    # One sequence: the body runs at P+T-1 = 4 positions: 2*4*144 = 1152; causal contexts 1+2+3+4 = 10, attention
    # 4 * d_q(4) * 10 = 160; the output layer at T = 3 positions: 2*3*4*10 = 240. Forward = 1552; G*B = 2 sequences.
    f = step_flops(SMALL)
    assert f.generation == 2 * 1552
    assert f.reference == 2 * 1552
    assert f.update == 3 * 2 * 1552  # forward + backward (2x) of trained weights, one iteration
    assert f.total == 15520


def test_flops_lora_two_iterations_by_hand():
    # LoRA r=1 on the 7 linears: 1*(8 + 6 + 6 + 8 + 12 + 12 + 12) = 64 weights, forward 2*4 positions*64 = 512.
    # Generation samples with the adapters: 2 * (1552 + 512) = 4128. The reference has them off: 2 * 1552 = 3104.
    # Each update: frozen base forward + activation gradients 2*1552, adapters 3*512 -> 4640; 2 sequences x 2
    # iterations -> 18560. No beta: no reference pass.
    w = dataclasses.replace(SMALL, lora_r=1, num_iterations=2)
    f = step_flops(w)
    assert (f.generation, f.reference, f.update) == (4128, 3104, 18560)
    assert step_flops(dataclasses.replace(w, beta=0.0)).reference == 0


def test_w2_floor_matches_the_issue_estimate():
    # The issue's estimate for W2: about 450 GFLOP per step, nearly all in the 151k-wide output layer.
    total = step_flops(WORKLOADS["W2"]).total / 1e9
    assert 430 < total < 470


def record(side, steps, gen, tokens=32, peak=100.0):
    """A side's run record (bench/child.py) on 2 threads, where CPU seconds are 1.5 x the wall seconds."""
    n = len(steps)
    out = {"side": side, "step_s": steps, "generation_s": gen, "scoring_s": [0.0] * n, "logprobs_s": [0.1] * n,
           "completion_tokens": [tokens] * n, "peak_rss_mb": peak, "setup_rss_mb": 50.0, "threads": 2}
    for key in ("step", "generation", "scoring", "logprobs"):
        out[f"{key}_cpu_s"] = [1.5 * v for v in out[f"{key}_s"]]
    return out


def test_summary_medians_ratios_and_floor():
    w = WORKLOADS["mini"]  # B*G*T = 2*2*8 = 32 completion tokens per step
    # Warm-up of 1 drops the first step of each run. grpo's steady steps: 1, 3 (run 1) and 2 (run 2): median 2 s,
    # 16 tokens/s. TRL's: 4, 4, 8: median 4 s, 8 tokens/s. Speedup 2; memory 100/400 = 0.25.
    records = {"grpo": [record("grpo", [9.0, 1.0, 3.0], [0.5] * 3), record("grpo", [9.0, 2.0], [0.5] * 2)],
               "trl": [record("trl", [9.0, 4.0, 4.0], [1.0] * 3, peak=400.0), record("trl", [9.0, 8.0], [1.0] * 2)]}
    out = summarize(w, records, warmup=1, matmul={"gflops": 1.0, "gflops_per_cpu_s": 0.5})
    assert out["grpo_s_per_step"] == 2.0 and out["trl_s_per_step"] == 4.0
    assert out["grpo_tokens_per_s"] == 16.0 and out["trl_tokens_per_s"] == 8.0
    assert out["speedup"] == 2.0
    assert out["memory_ratio"] == 0.25
    floor_s = step_flops(w).total / 1e9  # at 1 GFLOP/s
    assert out["floor_s"] == pytest.approx(floor_s)
    assert out["grpo_floor_ratio"] == pytest.approx(2.0 / floor_s)
    # update = step - generation - scoring - log-probs: grpo's steady steps give 0.4, 2.4, 1.4 -> median 1.4.
    assert out["grpo_time_split_s"]["update"] == pytest.approx(1.4)
    assert out["grpo_steady_steps"] == 3
    # CPU seconds: 1.5 x wall on 2 threads -> utilization 0.75; the CPU floor is at 0.5 GFLOP per CPU second.
    assert out["grpo_cpu_s_per_step"] == 3.0 and out["grpo_cpu_util"] == 0.75
    assert out["grpo_cpu_split_s"]["update"] == pytest.approx(1.5 * 1.4)
    assert out["grpo_cpu_floor_ratio"] == pytest.approx(3.0 / (2 * floor_s))
    assert out["cpu_speedup"] == 2.0
    assert out["requirements"] == {}  # the miniature has no acceptance floors


def test_requirements_report_met_and_unmet_floors():
    out = {"speedup": 3.2, "memory_ratio": 0.7, "grpo_floor_ratio": None}
    assert requirements("W2", out) == {"speedup >= 3.0": True, "memory_ratio <= 0.6": False,
                                       "grpo_floor_ratio <= 1.5": None}


def test_summary_with_one_side_has_null_ratios():
    out = summarize(WORKLOADS["mini"], {"grpo": [record("grpo", [9.0, 1.0], [0.5, 0.5])]}, 1,
                    {"gflops": 1.0, "gflops_per_cpu_s": 1.0})
    assert out["grpo_tokens_per_s"] == 32.0
    assert out["trl_tokens_per_s"] is None and out["trl_floor_ratio"] is None
    assert out["speedup"] is None and out["cpu_speedup"] is None and out["memory_ratio"] is None


def test_different_work_is_an_error():
    with pytest.raises(RuntimeError, match="trl side generated 31"):
        check_identical_work([record("trl", [1.0, 1.0], [0.1, 0.1], tokens=31)], 32)


def test_rounds_alternate_which_side_goes_first():
    assert order(["grpo", "trl"], 3) == ["grpo", "trl", "trl", "grpo", "grpo", "trl"]


def test_tokenizer_eos_is_outside_the_model_vocabulary():
    tok = build_tokenizer(100)
    assert tok.eos_token_id == 100 and tok.pad_token_id == 100  # the model's logits cover ids 0..99 only
    texts = prompts(WORKLOADS["W1"], n=3)
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    assert [len(i) for i in ids] == [16, 16, 16] and max(map(max, ids)) < 100
    assert tok.decode(ids[0]) == texts[0] == "Tell a tale 0000"


def test_miniature_benchmark_end_to_end(tmp_path):
    try:
        import trl  # noqa: F401

        sides = "grpo,trl"
    except ImportError:  # the README's test command installs the project alone (.ci/run adds TRL)
        sides = "grpo"
    cmd = [sys.executable, str(ROOT / "bench" / "run.py"), "--workload", "mini", "--steps", "1", "--warmup", "1",
           "--rounds", "1", "--sides", sides, "--work-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, "stdout must be exactly the JSON line"
    out = json.loads(lines[0])
    required = ["grpo_tokens_per_s", "trl_tokens_per_s", "speedup", "grpo_peak_rss_mb", "trl_peak_rss_mb",
                "memory_ratio", "grpo_floor_ratio", "trl_floor_ratio"]
    assert set(required) <= set(out)
    assert out["completion_tokens_per_step"] == 2 * 2 * 8
    assert out["grpo_tokens_per_s"] > 0 and out["grpo_peak_rss_mb"] > 0 and out["grpo_floor_ratio"] > 0
    assert set(out["grpo_time_split_s"]) == {"generation", "scoring", "logprobs", "update"}
    if sides == "grpo":
        assert out["trl_tokens_per_s"] is None and out["speedup"] is None
    else:
        assert out["speedup"] == pytest.approx(out["grpo_tokens_per_s"] / out["trl_tokens_per_s"])
        assert out["memory_ratio"] == pytest.approx(out["grpo_peak_rss_mb"] / out["trl_peak_rss_mb"])


def test_ragged_summary_counts_each_sides_own_tokens():
    """A ragged workload's steps generate different numbers of tokens: each side's tokens per second are its steady
    steps' tokens over their seconds, with no floor; grpo_padded is set against grpo. grpo: steady steps of 2 and 4
    s generating 30 and 90 tokens -> 120 / 6 = 20 tokens/s. TRL: 8 s for 40 -> 5 tokens/s: speedup 4. Padded: 6 s
    for 60 -> 10 tokens/s: padded_speedup 2."""
    w = WORKLOADS["mini-ragged"]
    grpo = record("grpo", [9.0, 2.0, 4.0], [0.5] * 3)
    grpo["completion_tokens"] = [10, 30, 90]
    trl, padded = record("trl", [9.0, 8.0], [1.0] * 2, peak=400.0), record("grpo_padded", [9.0, 6.0], [1.0] * 2)
    trl["completion_tokens"], padded["completion_tokens"] = [10, 40], [10, 60]
    out = summarize(w, {"grpo": [grpo], "trl": [trl], "grpo_padded": [padded]}, warmup=1,
                    matmul={"gflops": 1.0, "gflops_per_cpu_s": 1.0})
    assert out["completion_tokens_per_step"] is None and "floor_s" not in out and out["grpo_floor_ratio"] is None
    assert out["grpo_tokens_per_s"] == 20.0 and out["grpo_completion_tokens_per_step"] == 60.0
    assert out["speedup"] == 4.0 and out["padded_speedup"] == 2.0
    assert out["padded_memory_ratio"] == 1.0 and out["memory_ratio"] == 0.25


def test_ragged_workload_model_ends_completions_at_its_last_token(tmp_path):
    from bench.model_files import write_model_dir
    from transformers import AutoTokenizer

    w = WORKLOADS["mini-ragged"]
    write_model_dir(w, tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_id == tok.pad_token_id == w.vocab - 1  # inside the model's logits: it can be sampled
    assert max(map(max, tok(prompts(w, n=4), add_special_tokens=False)["input_ids"])) < w.vocab - 1


def test_default_job_summary_speedup_and_accuracy_noise():
    from bench.default_job import summarize as summarize_job

    # grpo 100 and 120 s (median 110), TRL 330 s: speedup 3 (CPU seconds 90 and 100, median 95, against 285). Accuracies 0.45 +- 0.02 and 0.40 +- 0.015: the gap
    # 0.05 against sqrt(0.02^2 + 0.015^2) = 0.025, exactly two standard errors: the same accuracy, just.
    out = summarize_job({"grpo": [(100.0, 90.0), (120.0, 100.0)], "trl": [(330.0, 285.0)]},
                        {"grpo": {"accuracy": 0.45, "accuracy_se": 0.02}, "trl": {"accuracy": 0.40,
                                                                                  "accuracy_se": 0.015}})
    assert out["grpo_wall_s"] == 110.0 and out["speedup"] == 3.0
    assert out["grpo_cpu_s"] == 95.0 and out["cpu_speedup"] == 3.0  # CPU: medians 95 and 285
    assert out["accuracy_gap"] == pytest.approx(0.05) and out["accuracy_gap_se"] == pytest.approx(0.025)
    assert out["same_accuracy"]


def test_default_job_lag_side_runs_grpo_with_max_staleness_and_is_compared():
    from bench.default_job import command, summarize as summarize_job

    assert command("grpo-lag2", Path("o"), ["max_steps=3"])[-2:] == ["max_steps=3", "max_staleness=2"]
    # grpo 150 s, grpo-lag1 100 s, TRL 330 s: lag1_speedup 150 / 100 = 1.5, lag1_vs_trl 330 / 100 = 3.3.
    out = summarize_job({"grpo": [(150.0, 140.0)], "grpo-lag1": [(100.0, 180.0)], "trl": [(330.0, 300.0)]}, {})
    assert out["grpo-lag1_wall_s"] == 100.0 and out["lag1_speedup"] == 1.5 and out["lag1_vs_trl"] == 3.3


def test_default_job_threads_give_each_side_the_same_cores():
    """--threads 2 (the issue's 2-core comparison): grpo at lag 0 and TRL train with 2 torch threads (OMP too); a
    lagged trainer with 1 beside its one-thread worker; without --threads nothing changes (the recipe's 1)."""
    from bench.default_job import command, environment, side_threads

    assert command("grpo", Path("o"), ["max_steps=3"], threads=2)[-2:] == ["max_steps=3", "num_threads=2"]
    assert command("trl", Path("o"), [], threads=2)[-1] == "num_threads=2"
    assert command("grpo-lag1", Path("o"), [], threads=2)[-2:] == ["num_threads=1", "max_staleness=1"]
    assert command("grpo-lag2", Path("o"), [], threads=4)[-2:] == ["num_threads=3", "max_staleness=2"]
    assert [side_threads(s, 2) for s in ("grpo", "trl", "grpo-lag1")] == [2, 2, 1]
    assert environment(side_threads("grpo", 2))["OMP_NUM_THREADS"] == "2"
    assert command("grpo", Path("o"), [])[-1] == "output_dir=o" and environment()["OMP_NUM_THREADS"] == "1"


def test_lag_plot_draws_reward_against_wall_time(tmp_path):
    """A run with wall stamps is drawn against them; one without, against the running sum of time/step
    (steps of 2 s and 3 s: 2 then 5)."""
    from bench.lag_plot import STAMPS, draw, reward_by_time

    for lag, stamped in ((0, True), (1, False)):
        run = tmp_path / f"lag{lag}"
        run.mkdir()
        rows = [{"step": 1, "reward/total": 0.25, "time/step": 2.0}, {"step": 2, "reward/total": 0.5, "time/step": 3.0}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if stamped:
            (run / STAMPS).write_text(json.dumps([[1, 10.5], [2, 12.0]]))
    assert reward_by_time(tmp_path / "lag0") == ([10.5, 12.0], [0.25, 0.5], True)
    assert reward_by_time(tmp_path / "lag1") == ([2.0, 5.0], [0.25, 0.5], False)
    out = draw({0: tmp_path / "lag0", 1: tmp_path / "lag1"}, tmp_path / "plot.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trl_gets_the_default_jobs_settings_and_prompts_in_grpos_order(tmp_path):
    """Every loss, optimizer and sampling setting of the resolved recipe reaches TRL's config, and TRL's dataset is
    the prompts grpo's sampler draws, step by step, rendered with the task's prefill."""
    from bench.trl_default_job import ordered_prompts, resolved_config, settings
    from grpo.tasks import get_task
    from grpo.training.data.prompts import PromptSampler

    cfg = resolved_config(["max_steps=3", "task_train_size=50", "loss_aggregation=token_mean", "beta=0.1"])
    got = settings(cfg, tmp_path)
    assert (got["learning_rate"], got["lr_scheduler_type"], got["beta"], got["loss_type"]) == (2e-4, "cosine", 0.1,
                                                                                              "dapo")
    assert (got["num_generations"], got["per_device_train_batch_size"], got["gradient_accumulation_steps"]) == (8, 64, 1)
    assert got["max_completion_length"] == 64 and got["max_steps"] == 3 and not got["shuffle_dataset"]
    assert got["gradient_checkpointing"] is False and got["bf16"] is False
    rows = ordered_prompts(cfg)
    train = get_task("arithmetic").dataset("train", n=50, seed=cfg.seed)
    sampler = PromptSampler(50, cfg.seed)
    order = [i for _ in range(3) for i in sampler.next(8)]
    assert len(rows["prompt"]) == 24 and rows["answer"] == [train[i]["answer"] for i in order]
    assert rows["prompt"] == [train[i]["prompt"] + "<think>" for i in order]


# (CI time: test_miniature_benchmark_end_to_end runs both sides of the benchmark in CI)
@pytest.mark.slow
def test_default_job_benchmark_end_to_end(tmp_path):
    """`python -m bench.default_job` with a one-step recipe: both whole commands run, both final models are scored
    by `grpo eval`, and the JSON line carries both wall times and accuracies (TRL's side where TRL is installed)."""
    try:
        import trl  # noqa: F401

        sides = "grpo,trl"
    except ImportError:
        sides = "grpo"
    cmd = [sys.executable, "-m", "bench.default_job", "max_steps=1", "task_train_size=40", "task_eval_size=4",
           "save_steps=0", "--eval-n", "6", "--eval-k", "1", "--sides", sides, "--work-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["grpo_wall_s"] > 0 and 0 <= out["grpo_accuracy"] <= 1 and out["grpo_accuracy_se"] >= 0
    assert (tmp_path / "grpo-0" / "final" / "config.json").exists()
    if sides == "grpo,trl":
        assert out["trl_wall_s"] > 0 and 0 <= out["trl_accuracy"] <= 1
        assert out["speedup"] == pytest.approx(out["trl_wall_s"] / out["grpo_wall_s"])
        assert (tmp_path / "trl-0" / "final" / "config.json").exists()


def test_server_lag_names_its_sides_and_compares_each_to_lag_0():
    """bench.server_lag: lagK and lagK-Nservers, anything else refused by name; the speedup is lag 0's wall seconds
    over the side's (60 / 40 = 1.5), and the accuracy gap 0.46 - 0.50 = -0.04 is within two standard errors of the
    difference (2 x sqrt(0.02^2 + 0.02^2) = 0.057), 0.40 - 0.50 = -0.10 is not."""
    from bench.server_lag import parse_side, summarize

    assert parse_side("lag0") == (0, 1) and parse_side("lag2-2servers") == (2, 2)
    with pytest.raises(SystemExit, match="name sides lagK or lagK-Nservers"):
        parse_side("lag1-servers")
    out = summarize({"lag0": 60.0, "lag1": 40.0, "lag2": 30.0},
                    {"lag0": {"accuracy": 0.50, "accuracy_se": 0.02}, "lag1": {"accuracy": 0.46, "accuracy_se": 0.02},
                     "lag2": {"accuracy": 0.40, "accuracy_se": 0.02}})
    assert out["lag1_speedup"] == 1.5 and out["lag2_speedup"] == 2.0
    assert out["lag1_same_accuracy"] is True and out["lag2_same_accuracy"] is False


def test_server_lag_reads_the_step_phases_and_the_ceiling_they_imply(tmp_path):
    """bench.server_lag.phases: medians over the steps after the first (steps 2-4: generation 0.3, 0.5, 0.4 ->
    0.4; update 0.5, 0.7, 0.6 -> 0.6; step 1.0, 1.2, 1.0 -> 1.0; step 1's 9 s of start-up left out). Lag 0's ceiling:
    1.0 / max(0.4, 1.0 - 0.4) = 1.0 / 0.6 = 5/3."""
    import json

    from bench.server_lag import phases, summarize

    rows = [(9.0, 9.0, 9.0), (0.3, 0.5, 1.0), (0.5, 0.7, 1.2), (0.4, 0.6, 1.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "time/generation": g, "time/update": u, "time/step": t}) + "\n"
        for i, (g, u, t) in enumerate(rows)) + json.dumps({"step": 4, "eval/accuracy": 0.5}) + "\n")
    assert phases(tmp_path) == {"generation_s": 0.4, "update_s": 0.6, "step_s": 1.0}
    out = summarize({"lag0": 60.0}, {}, {"lag0": phases(tmp_path)})
    assert out["lag0_step_ceiling"] == pytest.approx(5 / 3) and out["lag0_update_s"] == 0.6
