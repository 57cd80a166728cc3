"""GRPO math against numbers worked out by hand (the derivation is in each comment).

Expected values are literals, never re-derived with the code's own formula. Where eps = 1e-6
enters, the literal was evaluated once from the hand expression in the comment.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlflow.train.grpo import (
    ClipTerms,
    clipped_pg_loss,
    entropy_from_logits,
    group_advantages,
    kl_estimate,
    masked_mean,
    token_logprobs,
    token_mult_prob_error,
    valid_counts,
)


def close(actual, expected, tol=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=tol)


# ---------------------------------------------------------------- advantages

# Two prompts, four generations. Group 0 = [1, 0, 0, 1], group 1 = [0, 0, 0, 1].
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)


def test_group_mean_baseline():
    # means 0.5 and 0.25
    close(
        group_advantages(REWARDS, leave_one_out=False, normalize=False),
        [[0.5, -0.5, -0.5, 0.5], [-0.25, -0.25, -0.25, 0.75]],
    )


def test_group_mean_baseline_normalised():
    # group 0: sample var = 4 * 0.25 / 3 = 1/3, std = 0.57735; 0.5 / (0.57735027 + 1e-6)
    # group 1: sample var = (3 * 0.0625 + 0.5625) / 3 = 0.25, std = 0.5; -0.25 / 0.500001 ...
    close(
        group_advantages(REWARDS, leave_one_out=False, normalize=True),
        [
            [0.8660239037870368, -0.8660239037870368, -0.8660239037870368, 0.8660239037870368],
            [-0.499999000002, -0.499999000002, -0.499999000002, 1.499997000006],
        ],
    )


def test_leave_one_out_baseline():
    # group 0, i=0: others [0, 0, 1], mean 1/3, A = 2/3; i=1: others [1, 0, 1], A = -2/3
    # group 1, i=0: others [0, 0, 1], A = -1/3;            i=3: others [0, 0, 0], A = 1
    close(
        group_advantages(REWARDS, leave_one_out=True, normalize=False),
        [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [-1 / 3, -1 / 3, -1 / 3, 1.0]],
    )


def test_leave_one_out_normalised():
    # every "others" triple with spread is {0, 0, 1} or {1, 1, 0}: sample var = (2/9 + 4/9) / 2
    # = 1/3, std 0.57735: (2/3) / (0.57735027 + 1e-6) = 1.15470, (-1/3) / ... = -0.57735.
    # group 1, i=3: others [0, 0, 0] have no spread, so A = 1 stays unnormalised.
    close(
        group_advantages(REWARDS, leave_one_out=True, normalize=True),
        [
            [1.1546985383827155, -1.1546985383827155, -1.1546985383827155, 1.1546985383827155],
            [-0.5773492691913578, -0.5773492691913578, -0.5773492691913578, 1.0],
        ],
    )


def test_fractional_rewards_both_baselines():
    rewards = torch.tensor([[0.2, 0.5, 0.8]], dtype=torch.float64)
    # mean 0.5, std sqrt((0.09 + 0 + 0.09) / 2) = 0.3: 0.3 / 0.300001 = 0.99999667
    close(
        group_advantages(rewards, leave_one_out=False, normalize=True),
        [[-0.9999966666777779, 0.0, 0.9999966666777779]],
    )
    # i=0: others [0.5, 0.8], mean 0.65, A = -0.45, std sqrt(2 * 0.15^2 / 1) = 0.212132
    # i=1: others [0.2, 0.8], mean 0.5, A = 0.       i=2: mirror of i=0.
    close(group_advantages(rewards, leave_one_out=True, normalize=False), [[-0.45, 0.0, 0.45]])
    close(
        group_advantages(rewards, leave_one_out=True, normalize=True),
        [[-2.121310343606783, 0.0, 2.121310343606783]],
    )


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_group_without_spread_gets_exact_zeros(leave_one_out, normalize):
    # In fp32 the mean of eight 0.1s is 0.1 + 7.5e-9, and torch.std gives 8e-9, not 0: dividing
    # that residue by (8e-9 + 1e-6) would hand every generation an advantage of ~0.007. A group
    # whose rewards are all equal must get exactly zero.
    rewards = torch.tensor([[0.1] * 8, [1.0, 0.0] * 4])
    advantages = group_advantages(rewards, leave_one_out, normalize)
    assert torch.equal(advantages[0], torch.zeros(8))
    assert advantages[1].abs().min() > 0.4


def test_leave_one_out_others_without_spread_are_not_sharpened():
    # fp32, G = 8. i=7: others are seven 0.1s (no spread; fp32 rounding gives a variance of
    # 6e-17, not 0) -> A = 0.7 - 0.1 = 0.6 unnormalised, not 0.6 / (8e-9 + 1e-6) = 6e5.
    # i<7: others six 0.1s and 0.7, mean 13/70, A = 0.1 - 13/70 = -3/35,
    # var (6 (6/70)^2 + (36/70)^2) / 6 = 36/700, so A / std = -1/sqrt(7) = -0.3779628 (eps aside).
    rewards = torch.tensor([[0.1] * 7 + [0.7]])
    close(
        group_advantages(rewards, leave_one_out=True, normalize=True),
        [[-0.3779628063499098] * 7 + [0.6]],
        tol=1e-5,
    )


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_single_generation_gets_zero_advantage(leave_one_out, normalize):
    rewards = torch.tensor([[0.7], [0.2]])
    assert torch.equal(group_advantages(rewards, leave_one_out, normalize), torch.zeros(2, 1))


def test_two_generations():
    rewards = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    # mean 0.5, std sqrt(0.5): 0.5 / (0.70710678 + 1e-6)
    close(
        group_advantages(rewards, leave_one_out=False, normalize=True),
        [[0.7071057811879616, -0.7071057811879616]],
    )
    # leave-one-out: the single other reward is the baseline; its std is undefined -> 0, so the
    # advantage is not normalised.
    close(group_advantages(rewards, leave_one_out=True, normalize=True), [[1.0, -1.0]])


def test_integer_rewards_give_float_advantages():
    advantages = group_advantages(torch.tensor([[1, 0]]), leave_one_out=False, normalize=False)
    assert advantages.dtype == torch.float32
    close(advantages, [[0.5, -0.5]])


def test_bad_rewards_are_refused():
    with pytest.raises(ValueError, match="2-D"):
        group_advantages(torch.ones(8), leave_one_out=True, normalize=True)
    with pytest.raises(ValueError, match="NaN or inf"):
        group_advantages(torch.tensor([[1.0, math.nan]]), leave_one_out=True, normalize=True)


# ---------------------------------------------------------------- KL


def test_k1_and_k3_values():
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    # k1 = logp - logp_ref
    close(kl_estimate(logprobs, ref, "k1"), [[0.5, -1.0]])
    # d = ref - logp = [-0.5, 1]; k3 = e^d - d - 1 = [e^-0.5 - 0.5, e - 2]
    close(kl_estimate(logprobs, ref, "k3"), [[0.10653065971263342, 0.7182818284590451]])


def test_k3_is_non_negative_and_zero_at_equality():
    torch.manual_seed(0)
    logprobs = -torch.rand(64, 32) * 10
    ref = -torch.rand(64, 32) * 10
    assert (kl_estimate(logprobs, ref, "k3") >= 0).all()
    assert torch.equal(kl_estimate(logprobs, logprobs, "k3"), torch.zeros(64, 32))


def test_estimators_average_to_kl_of_policy_from_reference():
    # tokens drawn from p = [1/2, 1/4, 1/4], reference q = [1/4, 1/2, 1/4]:
    # KL(p || q) = 1/2 ln 2 + 1/4 ln(1/2) + 0 = ln(2) / 4 = 0.1732868. Weighting each token's
    # estimate by p(x) is the exact expectation (and pins the direction of the KL).
    p = torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.5, 0.25]], dtype=torch.float64)
    for kind in ("k1", "k3"):
        close((p * kl_estimate(p.log(), q.log(), kind)).sum(), 0.17328679513998632)


def test_kl_log_ratio_is_clamped_to_20():
    logprobs = torch.tensor([[0.0, -math.inf]], requires_grad=True)
    ref = torch.tensor([[-100.0, -1.0]])
    # d = [-100, +inf] clamped to [-20, 20]: k1 = [20, -20]; k3 = [e^-20 + 19, e^20 - 21]
    close(kl_estimate(logprobs, ref, "k1"), [[20.0, -20.0]])
    k3 = kl_estimate(logprobs, ref, "k3")
    torch.testing.assert_close(
        k3.double(), torch.tensor([[19.000000002061153, 485165174.4097903]], dtype=torch.float64)
    )
    k3.sum().backward()
    assert torch.equal(logprobs.grad, torch.zeros(1, 2))  # flat beyond the clamp


def test_unknown_kl_kind_is_refused():
    with pytest.raises(ValueError, match="'k2'"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k2")


# ---------------------------------------------------------------- clipped loss


def loss_of(logprobs, old, advantages, mask, terms, tokens, seqs, kl=None):
    """clipped_pg_loss with this file's positional shorthand (the function takes keywords)."""
    return clipped_pg_loss(
        logprobs_BT=logprobs,
        old_logprobs_BT=old,
        advantages_B=advantages,
        mask_BT=mask,
        terms=terms,
        global_num_tokens=tokens,
        global_num_seqs=seqs,
        kl_BT=kl,
    )


def terms(kl_weight=0.0, token_level=True):
    return ClipTerms(0.2, 0.28, kl_weight, token_level, "token")


def one_token(advantage, ratio, clip_low=0.2, clip_high=0.28):
    """Loss, d loss / d logp and metrics for a single token with old logp = 0, logp = ln ratio."""
    logprobs = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, metrics = loss_of(
        logprobs,
        torch.zeros(1, 1, dtype=torch.float64),
        torch.tensor([advantage], dtype=torch.float64),
        torch.ones(1, 1),
        ClipTerms(clip_low, clip_high, kl_weight=0.0, token_level=True, ratio_level="token"),
        1.0,
        1.0,
    )
    loss.backward()
    return loss, logprobs.grad.item(), metrics


# (A, ratio, loss, grad, clipped side). Band [0.8, 1.28].
# Unclipped: loss = -A r and d(-A r)/d logp = -A r. Clipped: loss = -A (band edge), grad 0.
CLIP_CASES = [
    (2.0, 1.5, -2.56, 0.0, "high"),  # A > 0, r above 1 + 0.28: -2 * 1.28
    (-2.0, 0.5, 1.6, 0.0, "low"),  # A < 0, r below 1 - 0.2: 2 * 0.8
    (2.0, 1.1, -2.2, -2.2, None),  # inside the band
    (2.0, 1.25, -2.5, -2.5, None),  # inside only because clip_high (0.28) != clip_low (0.2)
    (-2.0, 0.9, 1.8, 1.8, None),  # inside the band, A < 0
    (2.0, 0.5, -1.0, -1.0, None),  # A > 0 below the band: min(r, clip r) = r, unclipped
    (-2.0, 1.5, 3.0, 3.0, None),  # A < 0 above the band: max(r, clip r) = r, unclipped
    (0.0, 1.5, 0.0, 0.0, None),  # no advantage, no clipping counted
]


@pytest.mark.parametrize(("advantage", "ratio", "loss", "grad", "side"), CLIP_CASES)
def test_clipping(advantage, ratio, loss, grad, side):
    actual_loss, actual_grad, metrics = one_token(advantage, ratio)
    close(actual_loss, loss, tol=1e-12)
    assert actual_grad == pytest.approx(grad, abs=1e-12)
    assert metrics["clip_high_fraction"].item() == (side == "high")
    assert metrics["clip_low_fraction"].item() == (side == "low")
    assert metrics["clip_fraction"].item() == (side is not None)
    assert metrics["ratio_mean"].item() == pytest.approx(ratio)


def ragged_batch():
    """Two sequences, 3 and 1 valid tokens, garbage (-inf, NaN) in the padding."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -math.inf, -math.inf]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -math.inf, -math.inf]])  # ratio 1
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, math.nan, math.nan]])
    return logprobs, old, torch.tensor([1.0, -2.0]), mask, kl


def ragged_loss(token_level):
    logprobs, old, advantages, mask, kl = ragged_batch()
    loss, metrics = loss_of(logprobs, old, advantages, mask, terms(0.5, token_level), 4.0, 2.0, kl)
    loss.backward()
    return loss, logprobs.grad, metrics


def test_token_level_normalisation():
    # r = 1, so l_t = -A + 0.5 kl_t: seq 0 -> -0.95, -0.9, -0.85; seq 1 -> 2 + 0.2 = 2.2
    # L = (-2.7 + 2.2) / 4 tokens = -0.125 = pg (-3 + 2) / 4 + kl 0.5 * (1.0) / 4
    loss, grad, metrics = ragged_loss(token_level=True)
    close(loss, -0.125)
    close(metrics["pg_loss"], -0.25)
    close(metrics["kl_loss"], 0.125)
    # dL/dlogp_t = -A r / 4 on valid tokens, 0 on padding (and no NaN from the -inf there)
    close(grad, [[-0.25, -0.25, -0.25], [0.5, 0.0, 0.0]])


def test_sequence_level_normalisation():
    # per-sequence means: seq 0 (-0.95 - 0.9 - 0.85) / 3 = -0.9, seq 1 2.2; (-0.9 + 2.2) / 2
    # = 0.65 = pg (-1 + 2) / 2 + kl 0.5 * (0.2 + 0.4) / 2
    loss, grad, metrics = ragged_loss(token_level=False)
    close(loss, 0.65)
    close(metrics["pg_loss"], 0.5)
    close(metrics["kl_loss"], 0.15)
    # dL/dlogp_t = -A r / (tokens in its sequence) / 2 sequences
    close(grad, [[-1 / 6, -1 / 6, -1 / 6], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("token_level", [True, False])
def test_token_metrics_do_not_depend_on_loss_mode(token_level):
    _, _, metrics = ragged_loss(token_level)
    close(metrics["kl"], (0.1 + 0.2 + 0.3 + 0.4) / 4)
    close(metrics["ratio_mean"], 1.0)
    close(metrics["clip_fraction"], 0.0)
    assert all(not value.requires_grad and value.dim() == 0 for value in metrics.values())


def test_clip_fractions_count_valid_tokens_by_side():
    # ratios [[1.5, 0.5, 1.0], [0.5, 1.5, pad]]; A = [1, -1]; 5 valid tokens
    # high side: seq 0 token 0 (A > 0, r 1.5). low side: seq 1 token 0 (A < 0, r 0.5).
    ratios = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 9.0]])
    _, metrics = loss_of(
        ratios.log(), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 1], [1, 1, 0]]),
        terms(), 5.0, 2.0,
    )  # fmt: skip
    close(metrics["clip_high_fraction"], 1 / 5)
    close(metrics["clip_low_fraction"], 1 / 5)
    close(metrics["clip_fraction"], 2 / 5)
    close(metrics["ratio_mean"], (1.5 + 0.5 + 1.0 + 0.5 + 1.5) / 5)
    close(metrics["kl"], 0.0)


@pytest.mark.parametrize("token_level", [True, False])
def test_micro_batches_add_up_to_the_full_batch(token_level):
    torch.manual_seed(0)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = (torch.arange(5) < lengths.unsqueeze(1)).long()
    logprobs = (-torch.rand(6, 5) * 3).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(6, 5)  # ratios on both sides of the band
    ref = logprobs.detach() + 0.2 * torch.randn(6, 5)
    advantages = torch.randn(6)
    num_tokens, num_seqs = valid_counts(mask)

    def rows_loss(rows):
        kl = kl_estimate(logprobs[rows], ref[rows], "k3")
        return loss_of(
            logprobs[rows], old[rows], advantages[rows], mask[rows], terms(0.1, token_level),
            num_tokens, num_seqs, kl,  # 0-d tensors, as the train loop passes them
        )  # fmt: skip

    whole, whole_metrics = rows_loss(slice(0, 6))
    (whole_grad,) = torch.autograd.grad(whole, logprobs)
    first, first_metrics = rows_loss(slice(0, 4))
    second, second_metrics = rows_loss(slice(4, 6))
    (parts_grad,) = torch.autograd.grad(first + second, logprobs)

    torch.testing.assert_close(first + second, whole)
    torch.testing.assert_close(parts_grad, whole_grad)
    for key, value in whole_metrics.items():
        torch.testing.assert_close(first_metrics[key] + second_metrics[key], value, msg=key)
    assert 0 < whole_metrics["clip_fraction"] < 1


def test_valid_counts():
    tokens, seqs = valid_counts(torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]]))
    assert (tokens.item(), seqs.item()) == (3, 2)


def test_loss_refuses_mismatched_shapes_and_counts():
    args = (torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages_B has shape"):
        loss_of(*args[:2], torch.zeros(2, 3), args[3], terms(), 6.0, 2.0)
    with pytest.raises(ValueError, match="kl_BT has shape"):
        loss_of(*args, terms(0.1), 6.0, 2.0, torch.zeros(2, 2))
    with pytest.raises(ValueError, match="global_num_tokens must be > 0"):
        loss_of(*args, terms(), 0.0, 2.0)


def test_loss_takes_keywords_only():
    """A swapped tensor or constant cannot slip through: positional calls are a TypeError."""
    args = (torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(TypeError):
        clipped_pg_loss(*args, terms=terms(), global_num_tokens=6.0, global_num_seqs=2.0)


# ---------------------------------------------------------------- logits and logprobs


def test_token_mult_prob_error():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    mask = torch.tensor([[1, 1, 0]])
    assert token_mult_prob_error(logprobs, logprobs, mask).item() == 1.0
    gen = torch.tensor([[-1.0, -2.0, 0.0]])
    train = torch.tensor([[-1.5, -2.0, -math.inf]])  # padding garbage is ignored
    # (e^0.5 + e^0) / 2 valid tokens
    close(token_mult_prob_error(gen, train, mask), 1.324360635350064)
    # divided by a global count of 4 tokens instead
    close(token_mult_prob_error(gen, train, mask, num_tokens=4.0), 0.662180317675032)


def test_entropy_of_uniform_is_log_vocab():
    close(entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), 1.9459101490553132))
    close(entropy_from_logits(torch.full((1, 1, 7), 5.0, dtype=torch.bfloat16)), [[math.log(7)]])


def test_entropy_values_and_masked_vocab():
    # p = [1/4, 3/4]: H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351
    close(entropy_from_logits(torch.tensor([[[0.0, math.log(3)]]])), [[0.5623351446188083]])
    logits = torch.tensor([[[0.0, 0.0, -math.inf]]], requires_grad=True)  # H = ln 2
    entropy = entropy_from_logits(logits)
    close(entropy, [[math.log(2)]])
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_token_logprobs_by_hand():
    # [0, ln 3] -> p = [1/4, 3/4]; token 1 -> ln 0.75.   [2, 2] -> token 0 -> ln 0.5
    logits = torch.tensor([[[0.0, math.log(3)], [2.0, 2.0]]])
    close(token_logprobs(logits, torch.tensor([[1, 0]])), [[-0.2876820724517809, math.log(0.5)]])
    # [1, 2, 3], token 2: 3 - ln(e + e^2 + e^3) = 3 - 3.40760596
    logits = torch.tensor([[[1.0, 2.0, 3.0]]], dtype=torch.bfloat16)
    result = token_logprobs(logits, torch.tensor([[2]]))
    assert result.dtype == torch.float32
    close(result, [[-0.40760596444438013]])


def test_token_logprobs_refuses_misaligned_tokens():
    with pytest.raises(ValueError, match="must be \\(B, T, V\\)"):
        token_logprobs(torch.zeros(2, 4, 10), torch.zeros(2, 3, dtype=torch.long))


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, math.nan], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    close(masked_mean(x, mask), 1.5)
    close(masked_mean(x, mask, dim=1), [1.5, 0.0])  # no valid entry -> 0
