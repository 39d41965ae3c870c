"""The trainer's wiring of every config key that reaches the pure math of `grpo.core`.

The core functions have their own tests (test_core_*.py); these check that the trainer hands each setting to them.
Each test runs a real trainer on the tiny model for one or two updates, with completions scripted by a rollout
engine of this file (so the rewards are known), and compares the trainer's numbers with the core function computed
here by hand with the configured setting:

* advantages: `batch.advantages` against `group_advantages` / `process_advantages` / `mix_advantages`;
* the loss: the logged `train/grad_norm` (the gradient norm before clipping; with num_iterations=2, the last
  iteration's) against the norm of the gradient of `policy_loss`, taken here from a forward pass of a fresh copy of
  the model loaded with the policy's weights; and the logged metrics (`policy/loss` = the token mean of the clipped
  surrogate, `policy/clip_frac*`, `policy/kl_divergence`, `policy/entropy`) against `policy_loss`'s metrics.

Every test also checks that the numbers it expects differ from those of the wrong setting it guards against (the
default, or the value a wiring slip would pass), so each can fail when the key is dropped. Only the trainer's public
surface is used: GRPOConfig, GRPOTrainer(...), rollout(), update(), train_step(), policy, and grpo.core.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.core import LossSettings, group_advantages, mix_advantages, policy_loss, process_advantages
from grpo.engines.head import token_entropy, token_logprobs

G, B = 4, 2  # completions per prompt, prompts per step: N = 8 rows, two groups
MAX_LEN = 8  # max_completion_length unless a test says otherwise
# Row i of every rollout completes with TEXTS[i]; the reward is the number of "a"s. Rows 3 and 6 fill MAX_LEN
# characters, so at max_completion_length=8 they stop without EOS (truncated); every other row ends with EOS.
TEXTS = ["a", "bb", "aab", "aaaaaaaa", "ab", "a", "bbbbbbba", "aa"]
REWARDS = torch.tensor([[1.0, 0.0, 2.0, 8.0], [1.0, 1.0, 1.0, 2.0]])  # TEXTS' "a" counts as (B, G)
LR = 1e-2  # large enough that one AdamW step moves the token ratios well past 1 +- 0.1 (checked where it matters)


def a_count(completions, **kwargs):
    """Outcome reward: the number of "a" characters."""
    return [float(c.count("a")) for c in completions]


def a_steps(completions, **kwargs):
    """Step reward: every character is a step ending on itself (exclusive end i + 1); "a" scores 1, others 0."""
    return [[(i + 1, 1.0 if ch == "a" else 0.0) for i, ch in enumerate(c)] for c in completions]


class ScriptedRollouts:
    """A rollout engine (duck-typed: `generate(prompt_ids, params, seeds)`): row i writes TEXTS[i] (the byte
    tokenizer makes one token per character), cut at params.max_new_tokens, and then EOS if there is room; a row
    that reaches max_new_tokens without EOS is truncated. It gives no log-probs. Records the params it was given."""

    def __init__(self, tokenizer):
        self.tokens = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
        self.eos = tokenizer.eos_token_id
        self.params = []

    def generate(self, prompt_ids, params, seeds):
        self.params.append(params)
        ids = []
        for i in range(len(prompt_ids)):
            row = self.tokens[i % len(self.tokens)][:params.max_new_tokens]
            ids.append(row + [self.eos] if len(row) < params.max_new_tokens else row)
        return SimpleNamespace(ids=ids, truncated=[row[-1] != self.eos for row in ids], logprobs=None)


def make_trainer(model_dir, tmp_path, step_reward_funcs=None, **overrides):
    values = dict(output_dir=str(tmp_path / "run"), task=None, num_generations=G, prompts_per_step=B,
                  max_completion_length=MAX_LEN, learning_rate=LR, beta=0.0, max_steps=4, save_steps=0, report_to=[],
                  log_completions_steps=0, seed=0, per_device_train_batch_size=4)  # 2 micro-batches of 4 rows
    values.update(overrides)
    from transformers import AutoTokenizer

    # Prompts of equal length (3 tokens): no left padding, so position ids are plain 0, 1, 2, ...
    data = Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]})
    return GRPOTrainer(model=model_dir, reward_funcs=[a_count], args=GRPOConfig(**values), train_dataset=data,
                       generator=ScriptedRollouts(AutoTokenizer.from_pretrained(model_dir)),
                       step_reward_funcs=step_reward_funcs)


# ---- by hand: a fresh copy of the model, its log-probs, and policy_loss's gradient norm ---------------------------
def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def fresh_model(model_dir, state=None):
    """The model as saved (the initial weights, i.e. the reference), or loaded with `state`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model


def forward_logits(model, batch):
    """(N, T, V) logits at the positions that predict the T completion tokens of the batch's rows."""
    T = batch.completion_mask.shape[1]
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions).logits
    return logits[:, -T - 1:-1]


def logprobs(model, batch, temperature=1.0):
    T = batch.completion_mask.shape[1]
    return token_logprobs(forward_logits(model, batch), batch.input_ids[:, -T:], temperature=temperature)


def by_hand(model_dir, state, batch, *, temperature=1.0, old_state=None, mask=None, advantages=None,
            ref_logp=None, **loss_kwargs):
    """policy_loss over the whole batch at once (no normalizer: the whole step's counts, which is what the trainer's
    normalizer gives its micro-batches) for the policy with weights `state`; old log-probs from `old_state`, or the
    policy's own detached ones (the first iteration over a rollout). Returns (metrics as floats, gradient norm)."""
    model = fresh_model(model_dir, state)
    logp = logprobs(model, batch, temperature)
    if old_state is None:
        old = logp.detach()
    else:
        with torch.no_grad():
            old = logprobs(fresh_model(model_dir, old_state), batch, temperature)
    out = policy_loss(logp, old, batch.advantages if advantages is None else advantages,
                      batch.completion_mask if mask is None else mask, LossSettings(**loss_kwargs), ref_logp=ref_logp)
    grads = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None))
    return {k: float(v) for k, v in out.metrics.items()}, float(norm)


def assert_close(got, want, rel=1e-4, abs_=1e-6, what=""):
    assert got == pytest.approx(want, rel=rel, abs=abs_), (what, got, want)


def assert_apart(a, b, rel=1e-2, what=""):
    """The expected number and the wrong setting's differ by far more than the tolerance of the comparisons."""
    assert abs(a - b) > rel * max(abs(a), abs(b), 1e-3), (what, a, b)


# ---- outcome advantages: scale_rewards, advantage_eps, unbiased_std ------------------------------------------------
@pytest.mark.parametrize("overrides, core_kwargs", [
    ({"scale_rewards": "batch"}, {"scale": "batch"}),
    ({"scale_rewards": "none"}, {"scale": "none"}),
    ({"advantage_eps": 0.5}, {"eps": 0.5}),
    ({"unbiased_std": False}, {"unbiased": False}),
    ({"scale_rewards": "batch", "advantage_eps": 0.5, "unbiased_std": False},
     {"scale": "batch", "eps": 0.5, "unbiased": False}),
], ids=["scale_rewards=batch", "scale_rewards=none", "advantage_eps", "unbiased_std", "all_three"])
def test_outcome_advantages_follow_scale_eps_and_std(tiny_model_dir, tmp_path, overrides, core_kwargs):
    """batch.advantages == group_advantages(REWARDS, <configured scale/eps/unbiased>), and each setting changes them.

    Rewards (B, G) = [[1, 0, 2, 8], [1, 1, 1, 2]] (the "a" counts of TEXTS); group means 2.75 and 1.25. scale=none
    gives r - mean = [[-1.75, -2.75, -0.75, 5.25], [-0.25, -0.25, -0.25, 0.75]]. scale=group divides row 0 by its std
    3.594 (Bessel; population: 3.112) and row 1 by 0.5 (0.433); scale=batch divides both by the std of all 8
    rewards around their mean 2.0, 2.449 (population: 2.291); eps is added to the std.
    """
    trainer = make_trainer(tiny_model_dir, tmp_path, **overrides)
    batch = trainer.rollout()
    want = group_advantages(REWARDS, **core_kwargs).view(-1)
    torch.testing.assert_close(batch.advantages, want, rtol=1e-5, atol=1e-6)
    if core_kwargs == {"scale": "none"}:  # the derivation above, literally
        torch.testing.assert_close(batch.advantages, torch.tensor([-1.75, -2.75, -0.75, 5.25,
                                                                   -0.25, -0.25, -0.25, 0.75]))
    # Each configured option moves the advantages: the defaults (and each option left at its default) give others.
    for key, default in (("scale", "group"), ("eps", 1e-4), ("unbiased", True)):
        if key in core_kwargs:
            wrong = group_advantages(REWARDS, **{**core_kwargs, key: default}).view(-1)
            assert (wrong - want).abs().max() > 1e-2, key


# ---- loss aggregation (and max_completion_length for constant), with the step's normalizer ------------------------
@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
def test_loss_aggregation_reaches_the_gradient(tiny_model_dir, tmp_path, aggregation):
    """One update in 2 micro-batches: the gradient norm is that of policy_loss(aggregation=<configured>) over the
    whole batch, with max_length = max_completion_length (12 here, while the longest completion is 9 tokens).

    In the first iteration every ratio is 1, so each aggregation's loss is a differently weighted sum of -A_i *
    logp_it: sequence_mean 1/N sum_i 1/|o_i| sum_t, token_mean 1/sum|o_i| sum_i sum_t, constant 1/(N * 12) sum_i sum_t.
    The rows' lengths (2..9 tokens) differ, so each weighting gives another gradient norm; `policy/loss`, the token mean
    of the surrogate (-A per token here), is the same for all three and is checked too.
    """
    max_len = 12
    trainer = make_trainer(tiny_model_dir, tmp_path, loss_aggregation=aggregation, max_completion_length=max_len)
    state = weights(trainer)
    batch = trainer.rollout()
    assert batch.completion_mask.shape[1] == 9 < max_len  # "aaaaaaaa" + EOS; nothing truncated
    metrics = trainer.update(batch)

    want, norm = by_hand(tiny_model_dir, state, batch, aggregation=aggregation, max_length=max_len)
    assert_close(metrics["train/grad_norm"], norm, what="grad norm")
    assert_close(metrics["policy/loss"], want["policy_loss"], what="policy/loss")
    mask = batch.completion_mask
    assert_close(want["policy_loss"], float(-(batch.advantages[:, None] * mask).sum() / mask.sum()))
    others = [(a, max_len) for a in ("sequence_mean", "token_mean", "constant") if a != aggregation]
    if aggregation == "constant":  # the constant must be max_completion_length, not the batch's completion width
        others.append(("constant", batch.completion_mask.shape[1]))
    for other, length in others:
        assert_apart(norm, by_hand(tiny_model_dir, state, batch, aggregation=other, max_length=length)[1],
                     what=(other, length))
    # Micro-batching is exact only with the step's normalizer: each micro-batch's own count would give another norm.
    halves = [slice(0, 4), slice(4, 8)]
    model = fresh_model(tiny_model_dir, state)
    logp = logprobs(model, batch)
    settings = LossSettings(aggregation=aggregation, max_length=max_len)
    own = sum(policy_loss(logp[h], logp[h].detach(), batch.advantages[h], mask[h], settings).loss for h in halves)
    grads = torch.autograd.grad(own, list(model.parameters()))
    assert_apart(norm, float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))), what="per-micro-batch counts")


# ---- clip range (epsilon, epsilon_high) and importance_sampling_level: the second iteration over a rollout ---------
@pytest.mark.parametrize("level, epsilon, epsilon_high", [
    ("token", 0.1, 0.3),
    ("sequence", 0.1, 0.3),
    ("token", 0.1, None),  # epsilon_high unset: the config makes it epsilon
], ids=["token-0.1-0.3", "sequence-0.1-0.3", "token-0.1-unset"])
def test_second_iteration_clips_with_the_configured_range_and_ratio_level(tiny_model_dir, tmp_path, level, epsilon,
                                                                          epsilon_high):
    """num_iterations=2: the second iteration's ratios pi_1 / pi_0 (weights after one AdamW step at lr 1e-2 over the
    weights that sampled) spread over ~0.6..1.6, so the clip range [1 - epsilon, 1 + epsilon_high] and the ratio level
    decide which tokens are clipped, the surrogate and its gradient.

    The weights after the first step are those of a twin trainer with num_iterations=1 (the first iteration of a
    2-iteration update is the same AdamW step, the clip range playing no part at ratio 1). Logged metrics average
    both iterations over the same tokens: iteration 1 has ratio 1, clip fractions 0 and surrogate -A; the gradient
    norm is the second iteration's.
    """
    settings = dict(epsilon=epsilon, importance_sampling_level=level)
    if epsilon_high is not None:
        settings["epsilon_high"] = epsilon_high
    trainer = make_trainer(tiny_model_dir, tmp_path / "two", num_iterations=2, **settings)
    twin = make_trainer(tiny_model_dir, tmp_path / "one", num_iterations=1, **settings)
    state0 = weights(trainer)
    batch = trainer.rollout()
    metrics = trainer.update(batch)
    twin.update(twin.rollout())
    state1 = weights(twin)

    def expected(eps_low, eps_high, ratio_level):
        first, _ = by_hand(tiny_model_dir, state0, batch, eps_low=eps_low, eps_high=eps_high, ratio_level=ratio_level)
        second, norm = by_hand(tiny_model_dir, state1, batch, old_state=state0, eps_low=eps_low, eps_high=eps_high,
                               ratio_level=ratio_level)
        both = {k: (first[k] + second[k]) / 2 for k in ("policy_loss", "clip_frac_low", "clip_frac_high",
                                                         "clip_frac", "ratio_mean")}
        return both, second, norm

    eps_high = epsilon if epsilon_high is None else epsilon_high
    want, second, norm = expected(epsilon, eps_high, level)
    assert second["clip_frac"] > 0.05 and abs(second["ratio_mean"] - 1) > 1e-3  # the second iteration clips
    for key, value in want.items():
        assert_close(metrics["policy/loss" if key == "policy_loss" else f"policy/{key}"], value, what=key)
    assert_close(metrics["train/grad_norm"], norm, what="grad norm")

    def apart(other, what):  # some checked number differs by far more than the tolerance
        o_want, _, o_norm = other
        gaps = [abs(o_want[k] - want[k]) / max(abs(want[k]), 1e-3) for k in want]
        gaps.append(abs(o_norm - norm) / norm)
        assert max(gaps) > 1e-2, (what, o_want, o_norm, want, norm)

    apart(expected(epsilon, 0.2, level), "eps_high at the default epsilon 0.2")
    apart(expected(0.2, eps_high, level), "eps_low at the default 0.2")
    apart(expected(epsilon, 2 * eps_high, level), "a wider eps_high")
    if epsilon_high is not None:
        apart(expected(epsilon, epsilon, level), "eps_high = epsilon")
        apart(expected(epsilon_high, epsilon_high, level), "eps_low = epsilon_high")
    apart(expected(epsilon, eps_high, "sequence" if level == "token" else "token"), "the other ratio level")


# ---- KL term: kl_estimator and beta ---------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimator_and_beta_reach_the_loss(tiny_model_dir, tmp_path, estimator):
    """After one training step the policy differs from the reference (the initial weights); in the second step's
    update `policy/kl_divergence` is the token mean of kl_penalty(logp, ref_logp, <configured estimator>) and the
    gradient is that of the surrogate + beta * KL with the configured beta (0.25, not the default 0.04).
    batch.ref_logp is the reference's log-probs."""
    beta = 0.25
    trainer = make_trainer(tiny_model_dir, tmp_path, beta=beta, kl_estimator=estimator)
    trainer.train_step()
    state = weights(trainer)
    batch = trainer.rollout()
    metrics = trainer.update(batch)

    mask = batch.completion_mask.bool()
    with torch.no_grad():
        ref = logprobs(fresh_model(tiny_model_dir), batch)
    torch.testing.assert_close(batch.ref_logp[mask], ref[mask], rtol=1e-5, atol=1e-5)
    ref = torch.where(mask, batch.ref_logp, torch.zeros_like(ref))
    want, norm = by_hand(tiny_model_dir, state, batch, ref_logp=ref, beta=beta, kl_estimator=estimator)
    assert_close(metrics["policy/kl_divergence"], want["kl"], what="kl")
    assert_close(metrics["train/grad_norm"], norm, what="grad norm")
    assert want["kl"] > 1e-3  # the policy has moved away from the reference
    for other in {"k1", "k2", "k3"} - {estimator}:
        other_want, other_norm = by_hand(tiny_model_dir, state, batch, ref_logp=ref, beta=beta, kl_estimator=other)
        assert_apart(want["kl"], other_want["kl"], what=other)
        # (k2's and k3's gradients agree to first order in log r: their norms differ by ~0.2% here, 20x the tolerance)
        assert_apart(norm, other_norm, rel=1e-3, what=other)
    for other_beta in (0.0, 0.04):
        assert_apart(norm, by_hand(tiny_model_dir, state, batch, ref_logp=ref, beta=other_beta,
                                   kl_estimator=estimator)[1], what=("beta", other_beta))


# ---- temperature of the log-probs: policy, reference and entropy ---------------------------------------------------
def test_temperature_divides_the_logits_of_policy_and_reference(tiny_model_dir, tmp_path):
    """temperature=0.25: the rollout engine is asked for it, the reference's log-probs (batch.ref_logp), the loss's
    gradient and the logged entropy are those of softmax(logits / 0.25), not of the plain logits."""
    temperature = 0.25
    trainer = make_trainer(tiny_model_dir, tmp_path, temperature=temperature, beta=0.1)
    state = weights(trainer)
    batch = trainer.rollout()
    metrics = trainer.update(batch)
    assert [p.temperature for p in trainer.generator.params] == [temperature]
    assert trainer.generator.params[0].max_new_tokens == MAX_LEN

    mask = batch.completion_mask.bool()
    with torch.no_grad():
        logits = forward_logits(fresh_model(tiny_model_dir), batch)  # reference = policy = the saved weights
    T = mask.shape[1]
    ref = {t: token_logprobs(logits, batch.input_ids[:, -T:], temperature=t) for t in (temperature, 1.0)}
    torch.testing.assert_close(batch.ref_logp[mask], ref[temperature][mask], rtol=1e-5, atol=1e-5)
    assert (ref[1.0] - ref[temperature])[mask].abs().max() > 0.1

    entropy = {t: float(token_entropy(logits, temperature=t)[mask].mean()) for t in (temperature, 1.0)}
    assert_close(metrics["policy/entropy"], entropy[temperature], what="entropy")
    assert_apart(entropy[temperature], entropy[1.0], what="entropy")

    ref_t = torch.where(mask, batch.ref_logp, torch.zeros_like(batch.ref_logp))
    _, norm = by_hand(tiny_model_dir, state, batch, temperature=temperature, ref_logp=ref_t, beta=0.1)
    assert_close(metrics["train/grad_norm"], norm, what="grad norm")
    assert_apart(norm, by_hand(tiny_model_dir, state, batch, temperature=1.0, ref_logp=ref_t, beta=0.1)[1],
                 what="grad norm at temperature 1")


# ---- mask_truncated_completions ------------------------------------------------------------------------------------
def test_truncated_completions_leave_the_loss_but_not_the_group(tiny_model_dir, tmp_path):
    """mask_truncated_completions=True: rows 3 and 6 (8 characters, no EOS at max_completion_length 8) get an all-zero
    completion mask, so the loss and its gradient are policy_loss's with that mask; their rewards still count in the
    group statistics (the advantages are group_advantages of all 8 rewards)."""
    trainer = make_trainer(tiny_model_dir, tmp_path, mask_truncated_completions=True)
    state = weights(trainer)
    batch = trainer.rollout()
    metrics = trainer.update(batch)

    lengths = [len(t) + 1 if len(t) < MAX_LEN else 0 for t in TEXTS]  # + EOS; truncated rows: none
    want_mask = torch.tensor([[1.0 if j < n else 0.0 for j in range(MAX_LEN)] for n in lengths])
    torch.testing.assert_close(batch.completion_mask, want_mask)
    torch.testing.assert_close(batch.advantages, group_advantages(REWARDS).view(-1), rtol=1e-5, atol=1e-6)

    want, norm = by_hand(tiny_model_dir, state, batch)
    assert_close(metrics["train/grad_norm"], norm, what="grad norm")
    assert_close(metrics["policy/loss"], want["policy_loss"], what="policy/loss")
    unmasked = batch.attention_mask[:, -MAX_LEN:].float()  # every completion token, truncated rows included
    assert unmasked.sum() == want_mask.sum() + 2 * MAX_LEN
    assert_apart(norm, by_hand(tiny_model_dir, state, batch, mask=unmasked)[1], what="unmasked grad norm")


# ---- process supervision: outcome_weight, process_weight (and advantage_eps, unbiased_std for step rewards) -------
def test_process_and_outcome_weights_mix_token_advantages(tiny_model_dir, tmp_path):
    """With step rewards, batch.advantages (N, T) == mix_advantages(outcome, process, mask, 0.5, 2.0) where outcome =
    group_advantages(REWARDS, eps=0.3, unbiased=False) and process = process_advantages(step scores, step ends, mask,
    G, eps=0.3, unbiased=False); the step function scores every character (1 for "a"), so token t's process
    advantage is the sum of the normalized scores of characters t.. of its completion (0 on EOS). The update's
    gradient is policy_loss's with these per-token advantages."""
    cfg = dict(outcome_weight=0.5, process_weight=2.0, advantage_eps=0.3, unbiased_std=False)
    trainer = make_trainer(tiny_model_dir, tmp_path, step_reward_funcs=[a_steps], **cfg)
    state = weights(trainer)
    batch = trainer.rollout()
    metrics = trainer.update(batch)

    texts = [t[:MAX_LEN] for t in TEXTS]
    scores = [[1.0 if ch == "a" else 0.0 for ch in t] for t in texts]
    ends = [list(range(len(t))) for t in texts]
    lengths = [len(t) + 1 if len(t) < MAX_LEN else MAX_LEN for t in texts]
    mask = torch.tensor([[1.0 if j < n else 0.0 for j in range(MAX_LEN)] for n in lengths])
    torch.testing.assert_close(batch.completion_mask, mask)

    def mixed(eps_outcome=0.3, unbiased_outcome=False, eps_process=0.3, unbiased_process=False, w_o=0.5, w_p=2.0):
        outcome = group_advantages(REWARDS, eps=eps_outcome, unbiased=unbiased_outcome).view(-1)
        process = process_advantages(scores, ends, mask, G, eps=eps_process, unbiased=unbiased_process)
        return mix_advantages(outcome, process, mask, outcome_weight=w_o, process_weight=w_p)

    want = mixed()
    torch.testing.assert_close(batch.advantages, want, rtol=1e-5, atol=1e-5)
    for wrong in (dict(w_o=1.0), dict(w_p=1.0), dict(w_o=2.0, w_p=0.5), dict(eps_process=1e-4),
                  dict(unbiased_process=True), dict(eps_outcome=1e-4), dict(unbiased_outcome=True)):
        assert (mixed(**wrong) - want).abs().max() > 1e-2, wrong

    _, norm = by_hand(tiny_model_dir, state, batch)  # batch.advantages: the per-token ones just checked
    assert_close(metrics["train/grad_norm"], norm, what="grad norm")
    outcome_only = mixed(w_p=0.0) / 0.5  # the outcome advantages alone, per token
    assert_apart(norm, by_hand(tiny_model_dir, state, batch, advantages=outcome_only)[1], what="outcome only")


# ---- step metrics over num_iterations updates ---------------------------------------------------------------------
def test_each_optimizer_step_logs_the_entropy_of_its_own_pass(tiny_model_dir, tmp_path):
    """With num_iterations=2 a rollout feeds two optimizer steps; each logs the entropy of its own pass over the
    rollout (as TRL does): the first at the sampling weights, the second at the weights after the first step."""
    t = make_trainer(tiny_model_dir, tmp_path, num_iterations=2)
    start = weights(t)
    first = t.train_step()["policy/entropy"]
    middle = weights(t)
    second = t.train_step()["policy/entropy"]
    batch = t.loop.pending[0]
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        want = [float(token_entropy(forward_logits(fresh_model(tiny_model_dir, w), batch))[mask].mean())
                for w in (start, middle)]
    assert_close(first, want[0], what="entropy, first pass")
    assert_close(second, want[1], what="entropy, second pass")
    assert_apart(want[0], want[1], rel=2e-4, what="the two passes' entropies")  # (twice assert_close's tolerance)
