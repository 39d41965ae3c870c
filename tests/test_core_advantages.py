"""Tests of grpo.core.advantages: hand-derived golden values, edge cases, and vectorized-vs-loop checks."""

import math
import random
import statistics

import pytest
import torch

from grpo.core import group_advantages, mix_advantages, process_advantages

NAN = float("nan")


# --------------------------------------------------------------------------------------------------------------
# group_advantages: golden values
# --------------------------------------------------------------------------------------------------------------


def test_seed_example_eight_completions_four_correct():
    # Seed 000: G = 8 completions, 4 correct (reward 1) and 4 wrong (reward 0).
    #   mean = 4/8 = 0.5; every deviation is +-0.5, so sum of squares = 8 * 0.25 = 2.
    #   Bessel std = sqrt(2 / 7) = 0.534522 (the seed's "0.53");
    #   A = +-0.5 / 0.534522 = +-sqrt(7/8) = +-0.935414 with eps = 0 (the seed's "+-0.94"),
    #   and +-0.5 / (0.534522 + 1e-4) = +-0.935239 with our default eps = 1e-4; both round to +-0.935.
    rewards = torch.tensor([[1.0, 0, 1, 0, 1, 0, 1, 0]], dtype=torch.float64)
    std = math.sqrt(2 / 7)
    assert std == pytest.approx(0.5345, abs=1e-4)
    sign = torch.tensor([[1.0, -1, 1, -1, 1, -1, 1, -1]], dtype=torch.float64)

    exact = group_advantages(rewards, eps=0.0)
    torch.testing.assert_close(exact, sign * math.sqrt(7 / 8))
    default = group_advantages(rewards)
    torch.testing.assert_close(default, sign * 0.5 / (std + 1e-4))
    assert round(default[0, 0].item(), 3) == 0.935


def test_population_std_option():
    # Same rewards, unbiased=False: population std = sqrt(2 / 8) = 0.5, so A = +-0.5 / 0.5 = +-1.
    rewards = torch.tensor([[1.0, 0, 1, 0, 1, 0, 1, 0]])
    expected = torch.tensor([[1.0, -1, 1, -1, 1, -1, 1, -1]])
    torch.testing.assert_close(group_advantages(rewards, eps=0.0, unbiased=False), expected)


def test_scale_none_is_reward_minus_group_mean():
    # Seed 004's table: rewards [1, 0, 1, 0]. The seed writes group_mean = 0.625 and advantages [+0.375, -0.625],
    # but (1 + 0 + 1 + 0) / 4 = 0.5, so the right advantages are [+0.5, -0.5, +0.5, -0.5]. We test the math.
    # Seed 004's other example: [0.9, 0.7, 0.8, 0.4], mean 2.8 / 4 = 0.7 -> [+0.2, 0.0, +0.1, -0.3].
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.9, 0.7, 0.8, 0.4]], dtype=torch.float64)
    expected = torch.tensor([[0.5, -0.5, 0.5, -0.5], [0.2, 0.0, 0.1, -0.3]], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(rewards, scale="none"), expected)


def test_scale_batch_divides_by_batch_std_but_subtracts_group_mean():
    # rewards [[1, 0], [3, 3]]: group means 0.5 and 3.
    # Batch std over all four values: mean 1.75, deviations -0.75 -1.75 +1.25 +1.25,
    # squares 0.5625 + 3.0625 + 1.5625 + 1.5625 = 6.75, Bessel variance 6.75 / 3 = 2.25, std 1.5.
    # Row 0: (1 - 0.5) / 1.5 = +1/3 and (0 - 0.5) / 1.5 = -1/3. Row 1 has all rewards equal: 0.
    rewards = torch.tensor([[1.0, 0.0], [3.0, 3.0]], dtype=torch.float64)
    expected = torch.tensor([[1 / 3, -1 / 3], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(rewards, scale="batch", eps=0.0), expected)


def test_nan_rewards_are_left_out_and_get_zero():
    # [1, NaN, 0, 0]: statistics over [1, 0, 0]: mean 1/3, deviations 2/3, -1/3, -1/3,
    # Bessel variance (4/9 + 1/9 + 1/9) / 2 = 1/3, std 1/sqrt(3) = 0.57735.
    # A = (2/3) * sqrt(3) = 1.154701 and -(1/3) * sqrt(3) = -0.577350; the NaN entry gets 0.
    rewards = torch.tensor([[1.0, NAN, 0.0, 0.0]], dtype=torch.float64)
    root3 = math.sqrt(3)
    expected = torch.tensor([[2 / 3 * root3, 0.0, -root3 / 3, -root3 / 3]], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(rewards, eps=0.0), expected)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("eps", [0.0, 1e-4])
def test_groups_without_signal_get_exact_zero(scale, eps):
    # Each row is a group that carries no signal: all equal (0.1 is not exactly representable, so its float mean
    # differs from 0.1 in the last bit: a naive std test would leave ~1e-4 advantages), a single usable reward,
    # and all NaN. With eps = 0 a naive formula would give 0/0 = NaN.
    rewards = torch.tensor([[0.1, 0.1, 0.1], [2.0, NAN, NAN], [NAN, NAN, NAN]])
    out = group_advantages(rewards, scale=scale, eps=eps)
    assert torch.equal(out, torch.zeros_like(rewards))


def test_group_of_size_one_gets_zero():
    assert torch.equal(group_advantages(torch.tensor([[3.0], [-1.0]])), torch.zeros(2, 1))


def test_integer_rewards_and_dtype():
    out = group_advantages(torch.tensor([[1, 0]]), eps=0.0)
    # mean 0.5, Bessel std sqrt(0.5) -> +-0.5 / 0.70711 = +-0.70711
    torch.testing.assert_close(out, torch.tensor([[math.sqrt(0.5), -math.sqrt(0.5)]]))
    assert group_advantages(torch.zeros(2, 3, dtype=torch.float64)).dtype == torch.float64


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match=r"scale='grp' is not one of \('group', 'batch', 'none'\)"):
        group_advantages(torch.zeros(2, 2), scale="grp")
    with pytest.raises(ValueError, match=r"shape \(B, G\)"):
        group_advantages(torch.zeros(4))


# --------------------------------------------------------------------------------------------------------------
# group_advantages: vectorized vs an obviously-correct loop
# --------------------------------------------------------------------------------------------------------------


def _std(values, unbiased):
    return statistics.stdev(values) if unbiased else statistics.pstdev(values)


def slow_group_advantages(rewards, scale, eps, unbiased):
    """One group at a time, in Python floats, with the statistics module."""
    batch_values = [r for row in rewards for r in row if not math.isnan(r)]
    batch_std = _std(batch_values, unbiased) if len(batch_values) >= 2 else 0.0
    out = []
    for row in rewards:
        usable = [r for r in row if not math.isnan(r)]
        if len(usable) < 2 or len(set(usable)) == 1:
            out.append([0.0] * len(row))
            continue
        mean = sum(usable) / len(usable)
        divisor = {"group": _std(usable, unbiased) + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        out.append([0.0 if math.isnan(r) else (r - mean) / divisor for r in row])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_group_advantages_match_loop(seed):
    rng = random.Random(seed)
    num_groups, group_size = rng.randint(1, 6), rng.randint(1, 8)
    rewards = []
    for _ in range(num_groups):
        kind = rng.choice(["binary", "real", "equal", "nan"])
        row = [rng.choice([0.0, 1.0]) if kind == "binary" else round(rng.uniform(-2, 2), 3) for _ in range(group_size)]
        if kind == "equal":
            row = [row[0]] * group_size
        if kind == "nan":
            row = [NAN if rng.random() < 0.4 else r for r in row]
        rewards.append(row)
    tensor = torch.tensor(rewards, dtype=torch.float64)
    for scale in ("group", "batch", "none"):
        for unbiased in (True, False):
            expected = torch.tensor(slow_group_advantages(rewards, scale, 1e-4, unbiased), dtype=torch.float64)
            torch.testing.assert_close(group_advantages(tensor, scale, 1e-4, unbiased), expected)


# --------------------------------------------------------------------------------------------------------------
# process_advantages
# --------------------------------------------------------------------------------------------------------------


def test_process_advantages_hand_example():
    # One group of G = 2 completions, T = 5, eps = 0.
    #   completion 0: step rewards [1, 0] ending at tokens [1, 3]; all 5 tokens valid.
    #   completion 1: step reward [2] ending at token 9, past its last valid token 2 (mask [1, 1, 1, 0, 0]),
    #                 so it counts as ending at token 2.
    # R = {1, 0, 2}: mean 1, deviations 0, -1, +1, Bessel variance 2 / 2 = 1, std 1 -> normalized [0, -1] and [+1].
    # Advantage of token t = sum of normalized rewards of the steps ending at or after t:
    #   completion 0: t = 0, 1 -> 0 + (-1) = -1;  t = 2, 3 -> -1;  t = 4 -> no step left -> 0.
    #   completion 1: t = 0, 1, 2 -> +1;  t = 3, 4 are outside the mask -> 0.
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    out = process_advantages([[1.0, 0.0], [2.0]], [[1, 3], [9]], mask, group_size=2, eps=0.0)
    expected = torch.tensor([[-1.0, -1, -1, -1, 0], [1, 1, 1, 0, 0]])
    torch.testing.assert_close(out, expected)


def test_process_advantages_default_eps_and_population_std():
    # Same rewards with unbiased=False: population variance 2 / 3, std 0.816497; eps 1e-4 added.
    mask = torch.ones(2, 3, dtype=torch.bool)
    out = process_advantages([[1.0, 0.0], [2.0]], [[0, 2], [1]], mask, group_size=2, unbiased=False)
    z = 1 / (math.sqrt(2 / 3) + 1e-4)
    # completion 0: steps (0 at t0) and (-z at t2): every token t <= 2 sees the second step -> -z, -z, -z
    # completion 1: step +z ending at t1 -> +z, +z, 0
    torch.testing.assert_close(out, torch.tensor([[-z, -z, -z], [z, z, 0.0]]))


def test_process_advantages_degenerate_groups_are_zero():
    # Group 0 (rows 0-1): a single step reward in total. Group 1 (rows 2-3): all step rewards equal.
    # Group 2 (rows 4-5): no steps at all. All carry no signal -> 0 everywhere, never NaN (eps = 0).
    mask = torch.ones(6, 4, dtype=torch.bool)
    rewards = [[0.7], [], [0.3, 0.3], [0.3], [], []]
    ends = [[2], [], [0, 3], [1], [], []]
    out = process_advantages(rewards, ends, mask, group_size=2, eps=0.0)
    assert torch.equal(out, torch.zeros(6, 4))


def test_process_advantages_input_errors_name_the_row():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="completion 1 has 2 step rewards but 1 step ends"):
        process_advantages([[1.0], [1.0, 0.0]], [[0], [2]], mask, group_size=2)
    with pytest.raises(ValueError, match="group_size=3"):
        process_advantages([[1.0], [0.0]], [[0], [1]], mask, group_size=3)
    with pytest.raises(ValueError, match="one list per completion"):
        process_advantages([[1.0]], [[0]], mask, group_size=1)
    with pytest.raises(ValueError, match="completion 0 has a negative step end"):
        process_advantages([[1.0], [0.0]], [[-1], [1]], mask, group_size=2)


def slow_process_advantages(step_rewards, step_ends, mask, group_size, eps, unbiased):
    """Token by token, straight from the DeepSeekMath section 4.1.3 formula, in Python floats."""
    rows, length = len(mask), len(mask[0])
    out = [[0.0] * length for _ in range(rows)]
    for start in range(0, rows, group_size):
        members = range(start, start + group_size)
        pool = [r for i in members for r in step_rewards[i] if not math.isnan(r)]
        if len(pool) < 2 or len(set(pool)) == 1:
            continue
        mean, std = sum(pool) / len(pool), _std(pool, unbiased)
        for i in members:
            valid = [t for t in range(length) if mask[i][t]]
            if not valid:
                continue
            last = valid[-1]
            for t in valid:
                for r, end in zip(step_rewards[i], step_ends[i]):
                    if not math.isnan(r) and min(end, last) >= t:
                        out[i][t] += (r - mean) / (std + eps)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_process_advantages_match_loop(seed):
    rng = random.Random(seed)
    group_size, num_groups, length = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 9)
    rows = group_size * num_groups
    mask, step_rewards, step_ends = [], [], []
    for _ in range(rows):
        valid = rng.randint(0, length)  # 0 = empty completion
        row_mask = [t < valid for t in range(length)]
        if valid > 2 and rng.random() < 0.3:
            row_mask[rng.randrange(1, valid - 1)] = False  # a hole inside, e.g. masked tool output
        mask.append(row_mask)
        num_steps = rng.randint(0, 4)  # ragged, possibly zero steps
        step_rewards.append([NAN if rng.random() < 0.1 else rng.choice([0.0, 0.5, 1.0, rng.uniform(-1, 1)])
                             for _ in range(num_steps)])
        step_ends.append([rng.randint(0, length + 3) for _ in range(num_steps)])  # some past the mask or T
    mask_tensor = torch.tensor(mask, dtype=torch.bool)
    for unbiased in (True, False):
        expected = torch.tensor(slow_process_advantages(step_rewards, step_ends, mask, group_size, 1e-4, unbiased))
        out = process_advantages(step_rewards, step_ends, mask_tensor, group_size, unbiased=unbiased)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# mix_advantages
# --------------------------------------------------------------------------------------------------------------


def test_mix_advantages_weights_and_broadcast():
    # 0.5 * outcome (broadcast over tokens) + 2 * process, 0 outside the mask:
    #   row 0: 0.5 * 1 + 2 * [0.1, 0.2, 0.3] = [0.7, 0.9, 1.1]
    #   row 1: 0.5 * (-1) + 2 * [0.0, -0.5, 9.0] = [-0.5, -1.5, (masked) 0]
    outcome = torch.tensor([[1.0, -1.0]])  # (B, G) = (1, 2); (B*G,) works the same
    process = torch.tensor([[0.1, 0.2, 0.3], [0.0, -0.5, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    expected = torch.tensor([[0.7, 0.9, 1.1], [-0.5, -1.5, 0.0]])
    torch.testing.assert_close(mix_advantages(outcome, process, mask, 0.5, 2.0), expected)
    torch.testing.assert_close(mix_advantages(outcome.reshape(-1), process, mask, 0.5, 2.0), expected)
    with pytest.raises(ValueError, match="one outcome advantage per completion"):
        mix_advantages(torch.ones(3), process, mask)
