"""GRPO variants (issue 12): DAPO dynamic-sampling filter and overlong shaping, GSPO's
sequence-level ratio, TIS/MIS importance weights. Hand-computed values (derivations in the
comments; expected values are literals, never re-derived with the code's formula), then
hypothesis tests of the invariants each term must keep."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.train.grpo import (
    ClipTerms,
    clipped_pg_loss,
    group_advantages,
    importance_metrics,
    importance_weights,
    overlong_penalty,
    zero_variance_groups,
)


def close(actual, expected, tol=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=tol)


# ---------------------------------------------------------------- dynamic sampling


def test_zero_variance_groups():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.2, 0.2, 0.2], [0.0, 0.0, 1e-7]])
    assert zero_variance_groups(rewards).tolist() == [True, False, True, False]


# ---------------------------------------------------------------- overlong shaping


def test_overlong_penalty_by_hand():
    # max 8, buffer 4: free up to 8 - 4 = 4 tokens, then -(len - 4) / 4: 5 -> -0.25, 6 -> -0.5,
    # 8 -> -1; past max_new_tokens it stays at -penalty.
    penalty = overlong_penalty(torch.tensor([1, 3, 4, 5, 6, 7, 8, 9]), 8, 4, 1.0)
    close(penalty, [0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0])
    # penalty 0.5 scales it: 6 -> -0.25
    close(overlong_penalty(torch.tensor([6, 8]), 8, 4, 0.5), [-0.25, -0.5])
    # DAPO's own numbers: L_max 20480, L_cache 4096: a 18432-token answer gets -0.5
    close(overlong_penalty(torch.tensor([16384, 18432]), 20480, 4096, 1.0), [0.0, -0.5])


def test_overlong_penalty_off_and_bad_buffer():
    close(overlong_penalty(torch.tensor([8, 100]), 8, 0, 1.0), [0.0, 0.0])
    with pytest.raises(ValueError, match="buffer_tokens must be in"):
        overlong_penalty(torch.tensor([1]), 8, 9, 1.0)


# ---------------------------------------------------------------- importance sampling


def mismatch_batch():
    """Two rollouts; row 0 has 3 valid tokens, row 1 has 2 (then padding holding -inf)."""
    gen = torch.zeros(2, 3)
    # trainer logprobs: token ratios w = [1, 3, 0.5] and [1.5, 1.2, pad]
    train = torch.tensor(
        [[0.0, math.log(3), math.log(0.5)], [math.log(1.5), math.log(1.2), -math.inf]]
    )
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return train, gen, mask


def test_tis_truncates_token_weights_at_the_cap():
    train, gen, mask = mismatch_batch()
    weights, clipped = importance_weights(train, gen, mask, "tis", cap=2.0, mask_below=0.0)
    close(weights, [[1.0, 2.0, 0.5], [1.5, 1.2, 0.0]])  # 3 -> 2; padding 0 (not NaN from -inf)
    assert clipped.tolist() == [[False, True, False], [False, False, False]]
    metrics = importance_metrics(weights, clipped, mask, num_tokens=5.0)
    close(metrics["is_weight_mean"], (1 + 2 + 0.5 + 1.5 + 1.2) / 5)  # 1.24
    close(metrics["is_weight_max"], 2.0)
    close(metrics["is_clipped_fraction"], 1 / 5)


def test_mis_masks_whole_sequences_outside_the_band():
    train, gen, mask = mismatch_batch()
    # sequence ratios: row 0 = 1 * 3 * 0.5 = 1.5 (kept, every token weighs 1.5);
    # row 1 = 1.5 * 1.2 = 1.8: kept with cap 2, masked with cap 1.6
    weights, clipped = importance_weights(train, gen, mask, "mis", cap=2.0, mask_below=0.0)
    close(weights, [[1.5, 1.5, 1.5], [1.8, 1.8, 0.0]])
    assert not clipped.any()
    weights, clipped = importance_weights(train, gen, mask, "mis", cap=1.6, mask_below=0.0)
    close(weights, [[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]])
    assert clipped.tolist() == [[False, False, False], [True, True, False]]
    close(importance_metrics(weights, clipped, mask, 5.0)["is_clipped_fraction"], 2 / 5)
    # mask_below masks sequences far below 1 too: row 0 (1.5) < 1.55
    weights, _ = importance_weights(train, gen, mask, "mis", cap=2.0, mask_below=1.55)
    close(weights, [[0.0, 0.0, 0.0], [1.8, 1.8, 0.0]])


def test_identical_logprobs_give_weight_exactly_one():
    train = torch.tensor([[-0.7, -1.3, -2.0]])
    for kind in ("tis", "mis"):
        weights, clipped = importance_weights(
            train, train.clone(), torch.ones(1, 3), kind, 2.0, mask_below=0.0
        )
        assert weights.tolist() == [[1.0, 1.0, 1.0]] and not clipped.any()


def test_importance_weights_refuse_bad_input():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="must match"):
        importance_weights(x, torch.zeros(1, 3), torch.ones(1, 2), "tis", 2.0, mask_below=0.0)
    with pytest.raises(ValueError, match="unknown importance-sampling kind"):
        importance_weights(x, x, torch.ones(1, 2), "icepop", 2.0, mask_below=0.0)
    with pytest.raises(ValueError, match="cap > 0"):
        importance_weights(x, x, torch.ones(1, 2), "mis", 2.0, mask_below=3.0)


def loss_and_grad(
    logprobs, old, advantages, mask, token_level, seqs, ratio_level="token", is_weights_BT=None
):
    logprobs = logprobs.clone().double().requires_grad_()
    loss, metrics = clipped_pg_loss(
        logprobs_BT=logprobs,
        old_logprobs_BT=old.double(),
        advantages_B=advantages.double(),
        mask_BT=mask,
        terms=ClipTerms(0.2, 0.28, 0.0, token_level, ratio_level),
        global_num_tokens=float(mask.sum()),
        global_num_seqs=seqs,
        is_weights_BT=is_weights_BT,
    )
    loss.backward()
    return loss, logprobs.grad, metrics


def test_is_weights_scale_each_tokens_policy_gradient():
    # r = 1, A = 1, weights [2, 0.5]: l_t = -A r w_t -> -2, -0.5; token level over 2 tokens:
    # L = -1.25, dL/dlogp_t = -A r w_t / 2 = [-1, -0.25]
    lp = torch.tensor([[-1.0, -2.0]])
    loss, grad, _ = loss_and_grad(
        lp, lp, torch.tensor([1.0]), torch.ones(1, 2), True, 1.0,
        is_weights_BT=torch.tensor([[2.0, 0.5]]),
    )  # fmt: skip
    close(loss, -1.25, tol=1e-12)
    close(grad, [[-1.0, -0.25]], tol=1e-12)


def test_no_weights_and_unit_weights_give_the_identical_loss():
    torch.manual_seed(0)
    lp, old = -torch.rand(3, 4), -torch.rand(3, 4)
    adv, mask = torch.randn(3), torch.ones(3, 4)
    plain, plain_grad, _ = loss_and_grad(lp, old, adv, mask, True, 3.0)
    ones, ones_grad, _ = loss_and_grad(
        lp, old, adv, mask, True, 3.0, is_weights_BT=torch.ones(3, 4)
    )
    assert plain.item() == ones.item() and torch.equal(plain_grad, ones_grad)


# ---------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_by_hand():
    # token log-ratios ln 1.1, ln 1.3: rho_seq = exp(mean) = sqrt(1.1 * 1.3) = sqrt(1.43)
    # = 1.1958260743101399, inside [0.8, 1.28]. A = 1, one sequence, sequence-level loss:
    # L = -A rho_seq = -1.19582607; dL/dlogp_t = -A rho_seq / 2 (the mean over 2 tokens)
    lp = torch.tensor([[math.log(1.1), math.log(1.3)]], dtype=torch.float64)
    loss, grad, metrics = loss_and_grad(
        lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), False, 1.0,
        ratio_level="sequence",
    )  # fmt: skip
    close(loss, -1.1958260743101399, tol=1e-12)
    close(grad, [[-0.5979130371550699, -0.5979130371550699]], tol=1e-12)
    close(metrics["ratio_mean"], 1.1958260743101399)


def test_gspo_clips_the_whole_sequence():
    # rho_seq = exp(mean(ln 1.5, ln 1.5)) = 1.5 > 1.28 with A > 0: loss -1.28, no gradient,
    # and both tokens count as clipped; a second sequence at ratio 1 is unclipped (A = -1).
    lp = torch.tensor([[math.log(1.5), math.log(1.5)], [0.0, 0.0]], dtype=torch.float64)
    loss, grad, metrics = loss_and_grad(
        lp, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2), False, 2.0,
        ratio_level="sequence",
    )  # fmt: skip
    close(loss, (-1.28 + 1.0) / 2, tol=1e-12)
    close(grad, [[0.0, 0.0], [0.25, 0.25]], tol=1e-12)
    close(metrics["clip_high_fraction"], 2 / 4)


def test_unknown_ratio_level_is_refused():
    with pytest.raises(ValueError, match="unknown ratio_level"):
        loss_and_grad(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1),
                      True, 1.0, ratio_level="group")  # fmt: skip


# ---------------------------------------------------------------- invariants (hypothesis)

lengths = st.lists(st.integers(0, 64), min_size=1, max_size=16)


@settings(max_examples=60, deadline=None)
@given(lengths, st.integers(1, 64), st.data(), st.floats(0.0, 4.0))
def test_overlong_penalty_invariants(lens, max_new, data, penalty):
    buffer = data.draw(st.integers(0, max_new))
    values = overlong_penalty(torch.tensor(lens), max_new, buffer, penalty)
    assert ((values <= 0) & (values >= -penalty - 1e-12)).all()
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    ordered = values[order]
    assert (ordered[1:] <= ordered[:-1] + 1e-12).all()  # never rewards a longer answer more
    free = torch.tensor(lens) <= max_new - buffer
    assert (values[free] == 0).all()


def mismatch(draw_data, rows, cols):
    train = draw_data.draw(
        st.lists(st.floats(-30, 0, allow_nan=False), min_size=rows * cols, max_size=rows * cols)
    )
    noise = draw_data.draw(
        st.lists(st.floats(-3, 3, allow_nan=False), min_size=rows * cols, max_size=rows * cols)
    )
    valid = draw_data.draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))
    train_BT = torch.tensor(train).view(rows, cols)
    gen_BT = train_BT + torch.tensor(noise).view(rows, cols)
    return train_BT, gen_BT, torch.tensor(valid).view(rows, cols)


@settings(max_examples=80, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(1, 6), st.floats(0.5, 10.0))
def test_tis_weights_invariants(data, rows, cols, cap):
    train, gen, mask = mismatch(data, rows, cols)
    weights, clipped = importance_weights(train, gen, mask, "tis", cap, mask_below=0.0)
    assert torch.isfinite(weights).all()
    assert ((weights >= 0) & (weights <= cap)).all()
    assert (weights[~mask] == 0).all() and not clipped[~mask].any()
    assert (weights[clipped] == cap).all()
    equal = mask & (train == gen)
    assert (weights[equal] == min(1.0, cap)).all()
    if mask.any():
        m = importance_metrics(weights, clipped, mask, float(mask.sum()))
        assert 0 <= m["is_clipped_fraction"] <= 1 and m["is_weight_max"] <= cap


@settings(max_examples=80, deadline=None)
@given(st.data(), st.integers(1, 4), st.integers(1, 6), st.floats(0.5, 10.0), st.floats(0, 1))
def test_mis_weights_invariants(data, rows, cols, cap, low_share):
    train, gen, mask = mismatch(data, rows, cols)
    low = cap * low_share
    weights, clipped = importance_weights(train, gen, mask, "mis", cap, low)
    for b in range(rows):
        row = weights[b][mask[b]]
        if row.numel():  # one weight per sequence: 0 (masked) or inside [low, cap]
            assert (row == row[0]).all()
            assert row[0] == 0 or low <= row[0] <= cap
            assert clipped[b][mask[b]].all() == (row[0] == 0)
        assert (weights[b][~mask[b]] == 0).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.2, 0.8, 1.0]), min_size=4, max_size=4),
                min_size=1, max_size=6), st.booleans(), st.booleans())  # fmt: skip
def test_zero_variance_groups_are_exactly_the_zero_advantage_groups(rewards, loo, normalize):
    rewards_PG = torch.tensor(rewards)
    flat = zero_variance_groups(rewards_PG)
    advantages = group_advantages(rewards_PG, loo, normalize)
    assert torch.equal(flat, (advantages == 0).all(1))


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(1, 3), st.integers(1, 6))
def test_gspo_at_ratio_one_matches_the_token_loss(data, rows, cols):
    # On-policy (logp == logp_old) every ratio is 1, so GSPO and token-ratio GRPO give the same
    # sequence-normalised loss and gradient; and a permutation of a sequence's tokens leaves
    # GSPO's ratio unchanged.
    values = data.draw(st.lists(st.floats(-5, 0), min_size=rows * cols, max_size=rows * cols))
    lp = torch.tensor(values).view(rows, cols)
    mask = torch.ones(rows, cols)
    adv = torch.tensor(data.draw(st.lists(st.floats(-2, 2), min_size=rows, max_size=rows)))
    token, token_grad, _ = loss_and_grad(lp, lp, adv, mask, False, float(rows))
    seq, seq_grad, _ = loss_and_grad(lp, lp, adv, mask, False, float(rows), ratio_level="sequence")
    torch.testing.assert_close(seq, token)
    torch.testing.assert_close(seq_grad, token_grad)
    old = lp - torch.tensor(data.draw(st.lists(st.floats(-0.1, 0.1), min_size=rows * cols,
                                               max_size=rows * cols))).view(rows, cols)  # fmt: skip
    flipped = torch.flip(lp, [1]), torch.flip(old, [1])
    _, _, m1 = loss_and_grad(lp, old, adv, mask, False, float(rows), ratio_level="sequence")
    _, _, m2 = loss_and_grad(*flipped, adv, mask, False, float(rows), ratio_level="sequence")
    torch.testing.assert_close(m1["ratio_mean"], m2["ratio_mean"])
