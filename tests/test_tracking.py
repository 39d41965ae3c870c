"""Tests of grpo.training.observe.tracking: metrics.jsonl, resume truncation, non-finite values, TensorBoard, samples, W&B."""

import json
import math
import sys
import types

import pytest

from grpo.training.observe.tracking import NullLogger, RunLogger, read_metrics


def lines_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_jsonl_rows_in_call_order_with_step_first(tmp_path):
    logger = RunLogger(tmp_path)
    logger.log(1, {"reward/total": 0.5, "policy/kl_divergence": 0.00123456789})
    logger.log(2, {"reward/total": 0.75, "completion/mean_length": 31})
    logger.log(2, {"eval/accuracy": 0.4})  # evaluation of the same step, logged separately
    logger.close()
    rows = lines_of(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 2]
    assert all(next(iter(row)) == "step" for row in rows)
    # 6 significant digits: 0.00123456789 -> 0.00123457; ints stay ints.
    assert rows[0] == {"step": 1, "reward/total": 0.5, "policy/kl_divergence": 0.00123457}
    assert rows[1]["completion/mean_length"] == 31 and isinstance(rows[1]["completion/mean_length"], int)
    assert rows[2] == {"step": 2, "eval/accuracy": 0.4}


def test_tensor_like_values_are_logged_as_floats(tmp_path):
    torch = pytest.importorskip("torch")
    logger = RunLogger(tmp_path)
    logger.log(1, {"loss": torch.tensor(0.25), "ok": True})
    assert lines_of(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 0.25, "ok": 1}]


def test_non_number_metric_names_key_and_step(tmp_path):
    logger = RunLogger(tmp_path)
    with pytest.raises(TypeError, match=r"step=3.*'reward/total'.*str"):
        logger.log(3, {"reward/total": "high"})


def test_reserved_and_decreasing_steps_are_errors(tmp_path):
    logger = RunLogger(tmp_path)
    with pytest.raises(ValueError, match="reserved key 'step'"):
        logger.log(1, {"step": 1.0})
    logger.log(5, {"x": 1.0})
    with pytest.raises(ValueError, match="step 4 is before the last logged step 5"):
        logger.log(4, {"x": 1.0})


def test_non_finite_values_are_kept_as_strings_and_read_back(tmp_path):
    logger = RunLogger(tmp_path)
    logger.log(1, {"loss": float("nan"), "reward/total": float("inf"), "grad_norm": float("-inf"), "kl": 0.1})
    text = (tmp_path / "metrics.jsonl").read_text()
    # Strict JSON: the bare tokens NaN/Infinity that Python's json writes by default must not appear.
    json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    assert json.loads(text) == {
        "step": 1, "loss": "NaN", "reward/total": "Infinity", "grad_norm": "-Infinity", "kl": 0.1}
    (row,) = read_metrics(tmp_path)
    assert math.isnan(row["loss"]) and row["reward/total"] == math.inf and row["grad_norm"] == -math.inf


def test_resume_drops_rows_after_checkpoint_step(tmp_path):
    logger = RunLogger(tmp_path)
    for step in range(1, 8):
        logger.log(step, {"reward/total": step / 10})
    logger.log_samples(4, [{"completion": "a"}])
    logger.log_samples(6, [{"completion": "b"}])
    logger.close()
    # Crash after step 7, last checkpoint at step 5: the resumed run redoes steps 6 and 7.
    resumed = RunLogger(tmp_path, resume_step=5)
    assert [row["step"] for row in lines_of(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step_000004.jsonl"]
    resumed.log(6, {"reward/total": 0.66})
    assert lines_of(tmp_path / "metrics.jsonl")[-1] == {"step": 6, "reward/total": 0.66}


def test_resume_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x"')
    RunLogger(tmp_path, resume_step=2)
    assert lines_of(path) == [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}]


def test_corrupt_middle_line_is_an_error_with_line_number(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        read_metrics(tmp_path)


def test_new_run_starts_a_fresh_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 9, "x": 1.0}\n')
    RunLogger(tmp_path).log(1, {"x": 2.0})
    assert lines_of(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 2.0}]


def test_unknown_report_to_lists_allowed_names(tmp_path):
    with pytest.raises(ValueError, match=r"unknown \['mlflow'\]; allowed are \['tensorboard', 'wandb', 'trackio'\]"):
        RunLogger(tmp_path, report_to=["tensorboard", "mlflow"])


def test_samples_file_per_step(tmp_path):
    logger = RunLogger(tmp_path)
    rows = [
        {"prompt": "2+2?", "completion": "<think>…</think> 4", "rewards": {"math_accuracy": 1.0}, "advantage": 0.7},
        {"prompt": "2+2?", "completion": "5", "rewards": {"math_accuracy": float("nan")}, "advantage": -0.7},
    ]
    logger.log_samples(10, rows)
    path = tmp_path / "samples" / "step_000010.jsonl"
    written = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert written[0] == rows[0]
    assert written[1]["rewards"] == {"math_accuracy": "NaN"}


def test_bad_sample_rows_name_step_and_row(tmp_path):
    logger = RunLogger(tmp_path)
    with pytest.raises(TypeError, match=r"step=3\): row 1 is str"):
        logger.log_samples(3, [{"completion": "a"}, "b"])
    with pytest.raises(TypeError, match=r"step=3\): row 0 is not JSON-serializable"):
        logger.log_samples(3, [{"completion": object()}])


def test_sample_images_are_written_once_as_png_thumbnails_and_named_in_the_rows(tmp_path, capsys):
    from PIL import Image

    red = Image.new("RGB", (64, 64), (255, 0, 0))
    wide = Image.new("RGB", (600, 300), (0, 0, 255))
    logger = RunLogger(tmp_path)
    logger.log_samples(1, [{"completion": "a", "images": [red]}, {"completion": "b", "images": [red]},
                           {"completion": "c", "images": [wide, red]}], print_rows=1)
    logger.log_samples(2, [{"completion": "d", "images": [Image.new("RGB", (64, 64), (255, 0, 0))]}])
    rows = lines_of(tmp_path / "samples" / "step_000001.jsonl") + lines_of(tmp_path / "samples" / "step_000002.jsonl")
    (red_path,), (wide_path, red_again) = rows[0]["images"], rows[2]["images"]
    assert rows[1]["images"] == [red_path] and red_again == red_path and rows[3]["images"] == [red_path]
    assert red_path.startswith("samples/images/") and red_path.endswith(".png") and wide_path != red_path
    assert sorted(p.name for p in (tmp_path / "samples" / "images").iterdir()) == sorted(
        p.rsplit("/", 1)[1] for p in (red_path, wide_path))  # one file per distinct image, each written once
    small, thumb = Image.open(tmp_path / red_path), Image.open(tmp_path / wide_path)
    assert small.size == (64, 64) and small.getpixel((10, 10)) == (255, 0, 0)  # under 256: kept as it is
    assert thumb.size == (256, 128) and thumb.getpixel((100, 50)) == (0, 0, 255)  # 600x300 shrunk to fit 256
    assert f"image: {red_path}" in capsys.readouterr().out  # the printed sample names its picture


def tensorboard_scalars(log_dir, tag):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(log_dir))
    acc.Reload()
    return [(event.step, event.value) for event in acc.Scalars(tag)]


def test_tensorboard_scalars_readable(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    logger = RunLogger(tmp_path, report_to=["tensorboard"], config={"lr": 1e-6})
    logger.log(1, {"reward/total": 0.25})
    logger.log(2, {"reward/total": 0.5})
    logger.log_samples(2, [{"completion": "x", "reward": 1.0}])
    logger.close()
    (events,) = (tmp_path / "runs").iterdir()  # transformers' default: output_dir/runs/<date>_<host>/
    assert tensorboard_scalars(events, "train/reward/total") == [(1, 0.25), (2, 0.5)]  # (train/: as transformers)


def test_tensorboard_resume_hides_steps_after_checkpoint(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    logger = RunLogger(tmp_path, report_to=["tensorboard"])
    for step in (1, 2, 3):
        logger.log(step, {"x": float(step)})
    logger.close()
    resumed = RunLogger(tmp_path, report_to=["tensorboard"], resume_step=1)
    resumed.log(2, {"x": 20.0})
    resumed.close()
    # purge_step=2 makes TensorBoard discard the first run's steps 2 and 3 (the resumed run writes in the same
    # runs/<date>_<host>/ directory).
    (events,) = (tmp_path / "runs").iterdir()
    assert tensorboard_scalars(events, "train/x") == [(1, 1.0), (2, 20.0)]


def test_null_logger_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    logger = NullLogger()
    logger.log(1, {"x": 1.0})
    logger.log_samples(1, [{"completion": "x"}])
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_wandb_missing_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        RunLogger(tmp_path, report_to=["wandb"])


class FakeRun:
    def __init__(self, run_id):
        self.id, self.logged, self.finished = run_id, [], False

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


def fake_wandb(inits):
    def init(**kwargs):
        inits.append(kwargs)
        return FakeRun(kwargs["id"] or "run-1")

    return types.SimpleNamespace(init=init, Table=lambda columns, data: ("table", columns, data))


def test_wandb_logs_and_resumes_the_same_run(tmp_path, monkeypatch):
    inits = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(inits))
    logger = RunLogger(tmp_path, report_to=["wandb"], config={"lr": 1e-6}, run_name="demo")
    logger.log(1, {"reward/total": 0.5})
    logger.log_samples(1, [{"completion": "x", "rewards": {"acc": 1.0}}])
    run = logger._wandb
    logger.close()
    assert inits[0]["name"] == "demo" and inits[0]["config"] == {"lr": 1e-6} and inits[0]["id"] is None
    assert run.logged[0] == (1, {"train/reward/total": 0.5})  # (as transformers' WandbCallback: train/<key>)
    assert run.logged[1] == (1, {"samples": ("table", ["completion", "rewards"], [["x", '{"acc": 1.0}']])})
    assert run.finished
    RunLogger(tmp_path, report_to=["wandb"], resume_step=1)
    assert inits[1]["id"] == "run-1" and inits[1]["resume"] == "allow"
