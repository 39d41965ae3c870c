"""Tests of grpo.training.observe.display: the plain line, ETA, alarm de-duplication, live mode on a fake terminal."""

import io

from rich.console import Console

from grpo.training.observe.display import LiveDisplay, NullDisplay, format_duration, format_number

METRICS = {
    "reward/total": 0.43,
    "reward/math_accuracy": 0.38,
    "reward/think_format": 0.92,
    "reward/math_accuracy/std": 0.2,  # not a per-function mean: not shown
    "eval/accuracy": 0.38,
    "policy/kl_divergence": 0.0012,
    "completion/mean_length": 31.2,
    "advantage/std": 0.3,  # not in the display
    "time/step": 1.25,
}


def plain_display(total_steps=200):
    out = io.StringIO()
    return LiveDisplay(total_steps, console=Console(file=out, width=60)), out


def test_plain_mode_prints_one_compact_line_per_update():
    display, out = plain_display()
    assert not display.live_mode  # a Console writing to a StringIO is not a terminal
    display.update(12, METRICS)
    # ETA = mean step time 1.25 s * (200 - 12) steps left = 235 s = 3m55s. The line is longer than the
    # console's 60 columns and must not be wrapped.
    assert out.getvalue() == (
        "step 12/200 | reward 0.43 (math_accuracy 0.38, think_format 0.92) | acc 0.38 | kl 0.0012 | len 31.2 | "
        "1.25 s/step | eta 3m55s\n"
    )


def test_missing_keys_are_not_shown_and_eta_averages_step_times():
    display, out = plain_display(total_steps=10)
    display.update(1, {"reward/format": 1.0, "time/step": 1.0})
    display.update(2, {"policy/kl_divergence": 0.05, "time/step": 3.0})
    display.update(3, {})
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 1/10 | reward (format 1) | 1 s/step | eta 9s"
    # Mean of 1 s and 3 s = 2 s/step, 8 steps left: 16 s.
    assert lines[1] == "step 2/10 | kl 0.05 | 3 s/step | eta 16s"
    # No time/step: measured from the wall clock since step 2 (near zero here), so the ETA is still about
    # the mean of (1, 3, ~0) * 7 = ~9 s.
    assert lines[2].startswith("step 3/10 | ") and lines[2].endswith("eta 9s")


def test_alarm_printed_once_while_active_and_again_after_it_clears():
    display, out = plain_display(total_steps=10)
    for step in (1, 2, 3):
        display.update(step, {})
        display.alarm("health/kl_high", f"KL 0.0{step + 5} above 0.05")
        display.alarm("health/kl_high", "raised twice in one step")
    display.update(4, {})  # step 4: no alarm, it has cleared
    display.update(5, {})
    display.alarm("health/kl_high", "KL 0.09 above 0.05")
    warnings = [line for line in out.getvalue().splitlines() if line.startswith("WARNING")]
    assert warnings == ["WARNING health/kl_high: KL 0.06 above 0.05", "WARNING health/kl_high: KL 0.09 above 0.05"]


def test_alarm_raised_before_update_is_also_deduplicated():
    display, out = plain_display(total_steps=10)
    for step in (1, 2, 3):
        display.alarm("health/adv_std_low", "advantage std 0.05 below 0.1 (no signal)")
        display.alarm("health/kl_high", "KL above 0.05")
        display.update(step, {})
    assert out.getvalue().count("WARNING health/adv_std_low") == 1
    assert out.getvalue().count("WARNING health/kl_high") == 1


def test_note_prints_its_message():
    display, out = plain_display()
    display.note("saved checkpoint-000050")
    display.close()
    assert out.getvalue() == "saved checkpoint-000050\n"


def test_live_mode_on_a_terminal_shows_progress_and_metrics():
    out = io.StringIO()
    display = LiveDisplay(20, console=Console(file=out, force_terminal=True, width=120))
    assert display.live_mode
    display.update(5, METRICS)
    display.alarm("health/kl_high", "KL 0.08 above 0.05")
    display.update(6, {k: v for k, v in METRICS.items() if k != "eval/accuracy"})
    display.close()
    display.close()
    text = out.getvalue()
    for expected in ("step 6/20", "1.25 s/step", "eta 18s", "math_accuracy", "think_format", "0.0012", "31.2",
                     "WARNING health/kl_high: KL 0.08 above 0.05", "active alarms: health/kl_high",
                     "acc@5"):  # step 6 has no evaluation: the live view keeps step 5's accuracy
        assert expected in text, expected
    assert "advantage" not in text


def test_enabled_false_forces_plain_lines_on_a_terminal():
    out = io.StringIO()
    display = LiveDisplay(4, enabled=False, console=Console(file=out, force_terminal=True, color_system=None))
    display.update(1, {"reward/total": 0.5})
    assert out.getvalue() == "step 1/4 | reward 0.5\n"


def test_null_display_accepts_calls():
    display = NullDisplay()
    display.update(1, METRICS)
    display.alarm("health/x", "message")
    display.note("note")
    display.close()


def test_number_and_duration_formats():
    assert [format_number(x) for x in (0.0012345, 0.43, 31.25, 1234.5, float("nan"))] == [
        "0.00123", "0.43", "31.2", "1234", "nan"]
    assert [format_duration(s) for s in (45.4, 232, 3720)] == ["45s", "3m52s", "1h02m"]
