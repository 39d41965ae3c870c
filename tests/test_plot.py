"""Tests of grpo.training.observe.plot: moving average, and plot_run on synthetic metrics.jsonl files."""

import json
import math
import random

import pytest

from grpo.training.observe.plot import moving_average, plot_run, series

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def synthetic_rows(steps=60, eval_every=10, with_eval=True):
    """A run whose accuracy rises from 0.2 to 0.7 with noise, format reward saturating early."""
    rng = random.Random(0)
    rows = []
    for step in range(1, steps + 1):
        acc = min(1.0, max(0.0, 0.2 + 0.5 * step / steps + rng.gauss(0, 0.1)))
        fmt = min(1.0, 0.3 + step / 10) if step < 8 else 1.0
        rows.append({"step": step, "reward/total": acc + fmt, "reward/math_accuracy": acc,
                     "reward/think_format": fmt, "reward/math_accuracy/std": 0.3,
                     "policy/kl_divergence": 0.0005 * step, "completion/mean_length": 40 - 0.2 * step,
                     "time/step": 1.0})
        if with_eval and step % eval_every == 0:
            rows.append({"step": step, "eval/accuracy": 0.2 + 0.5 * step / steps})
    return rows


def check_png(path, min_bytes=20_000):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    # A 9-inch-wide figure at 110 dpi with lines and text is tens of kB; an empty canvas is a few kB.
    assert len(data) > min_bytes, len(data)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    return width, height


def test_moving_average_by_hand():
    # window 2: [1], [1,3] -> 2, [3,5] -> 4, [5,7] -> 6
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([1.0, 3.0], 1) == [1.0, 3.0]


def test_series_skips_missing_and_non_finite():
    rows = [{"step": 1, "x": 1.0}, {"step": 2}, {"step": 3, "x": math.nan}, {"step": 4, "x": "NaN"},
            {"step": 5, "x": 2}]
    assert series(rows, "x") == ([1, 5], [1.0, 2.0])


def test_plot_run_writes_three_panel_png(tmp_path):
    run_dir = tmp_path / "gsm8k-qwen-run"
    write_metrics(run_dir, synthetic_rows())
    path = plot_run(run_dir)
    assert path == run_dir / "plot.png"
    width, height = check_png(path)
    assert (width, height) == (990, 968)  # 9 x (1 + 3 * 2.6) inches at 110 dpi: three panels


def test_plot_run_without_eval_and_kl_keys_has_fewer_panels(tmp_path):
    rows = [{k: v for k, v in row.items() if k in ("step", "reward/total", "reward/think_format")}
            for row in synthetic_rows(with_eval=False)]
    write_metrics(tmp_path / "run", rows)
    out = tmp_path / "elsewhere.png"
    assert plot_run(tmp_path / "run", out=out) == out
    assert check_png(out, min_bytes=10_000)[1] == 396  # (1 + 2.6) inches at 110 dpi: the reward panel only


def test_plot_run_reads_non_finite_values(tmp_path):
    rows = synthetic_rows(steps=20)
    rows[5]["reward/total"] = "NaN"
    rows[6]["policy/kl_divergence"] = "Infinity"
    write_metrics(tmp_path, rows)
    check_png(plot_run(tmp_path))


def test_plot_run_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist"):
        plot_run(tmp_path)
    write_metrics(tmp_path, [{"step": 1, "loss": 0.1}])
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_run(tmp_path)


def test_grpo_plot_of_a_directory_without_a_run_is_one_line(tmp_path, capsys):
    from grpo.cli import main

    assert main(["plot", str(tmp_path)]) == 2  # (was a FileNotFoundError traceback)
    assert capsys.readouterr().err.splitlines() == [f"grpo: error: plot_run: {tmp_path}/metrics.jsonl does not "
                                                    "exist; pass a run directory"]
