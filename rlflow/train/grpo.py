"""GRPO math: advantages, KL estimators, the clipped policy-gradient loss and its metrics.

Tensors in, tensors out: no model, no optimizer, no torch.distributed. Anything global (token and
sequence counts over the whole step, all micro-batches and all data-parallel ranks) is passed in,
so the train loop owns every collective.

Shape suffixes: `_PG` prompts x generations, `_BT` batch x tokens, `_BTV` batch x tokens x vocab,
`_B` batch. Masks are 0/1 (any non-zero entry counts as valid); positions outside the mask may
hold garbage (padding), which is kept out of every sum with `torch.where`, never multiplied by 0
(0 * inf is NaN, in the forward and in the backward pass).

Formulas (docs/grpo-math.md has the same with examples):
    advantage      A_i = r_i - b_i, divided by (s_i + eps) where s_i > 0 and normalisation is on
    ratio          rho_t = exp(logp_t - logp_old_t)
    per-token loss l_t = max(-A rho_t, -A clip(rho_t, 1 - clip_low, 1 + clip_high)) + beta kl_t
    token level    L = sum_{valid t} l_t / N_tokens(global)
    sequence level L = sum_b (mean_{valid t in b} l_t) / N_seqs(global)

Variants (each a recipe key; docs/grpo-math.md "GRPO variants"):
    GSPO           rho_b = exp(mean_{valid t in b} (logp_t - logp_old_t)), one ratio per sequence,
                   clipped like rho_t (loss.ratio_level: sequence)
    TIS            l_t *= min(w_t, C),  w_t = exp(logp_old_t - logp_gen_t)      (token, truncated)
    MIS            l_t *= w_b if low <= w_b <= C else 0,  w_b = prod_t w_t      (sequence, masked)
    overlong       r_i -= penalty * clamp((len_i - (L_max - L_buf)) / L_buf, 0, 1)   (DAPO)
    dynamic        groups whose rewards are all equal are dropped before the update (DAPO)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from rlflow.model.logits import entropy_from_logits  # noqa: F401 (grpo.entropy_from_logits)

# The log-ratio log(pi_ref / pi) fed to the KL estimators is clamped to [-20, 20], as in NeMo-RL
# (kl_input_clamp_value): exp(20) ~ 4.9e8 is finite in fp32 and bf16, so k3 cannot overflow to
# inf, and a -inf logprob (a token outside a top-k filter) gives a large finite KL, not inf/NaN.
# Beyond the clamp the gradient is zero. No output clamp: k3 stays an honest, if large, number.
KL_LOG_RATIO_CLAMP = 20.0


# ---------------------------------------------------------------- advantages


def group_advantages(
    rewards_PG: Tensor, leave_one_out: bool, normalize: bool, eps: float = 1e-6
) -> Tensor:
    """Per-group advantages (P, G) for P prompts with G generations each.

    Baseline b_i of generation i in its group of G rewards r_1..r_G:
      * leave_one_out=False: b_i = mean_j r_j (the group mean; GRPO).
      * leave_one_out=True:  b_i = mean_{j != i} r_j (the mean of the other G-1; RLOO).

    Spread s_i (used only when normalize=True), NeMo-RL's `calculate_baseline_and_std_per_prompt`
    exactly: the second moment is taken over the same samples as the baseline, times the Bessel
    factor n/(n-1) with n the number of samples in the baseline. That is:
      * leave_one_out=False: s_i = sample std of the whole group, divisor G-1.
      * leave_one_out=True:  s_i = sample std of the other G-1 rewards, divisor G-2. With G=2 one
        other reward has no spread, so s_i = 0 and the advantage is left unnormalised (NeMo-RL
        computes 0 * inf = NaN there and maps it to 0, the same result).
    Note that with leave-one-out s_i differs within a group: for rewards [1, 0, 0, 0] the first
    generation's others are [0, 0, 0] (s = 0, so A = 1, unnormalised), while the others get
    A = -(1/3) / sqrt(1/3).

    A_i = r_i - b_i; if normalize, A_i / (s_i + eps) wherever s_i > 0 (a zero spread is not
    sharpened). Spreads are computed as centred sums and "no spread" is decided by exact
    equality of rewards, not by rounding noise. A group whose rewards are all equal gets exactly
    zero advantage, and G=1 gives zeros. Non-finite rewards raise ValueError.
    """
    if rewards_PG.dim() != 2:
        raise ValueError(
            f"rewards_PG must be 2-D (prompts x generations), got shape {tuple(rewards_PG.shape)}"
        )
    rewards_PG = rewards_PG if rewards_PG.is_floating_point() else rewards_PG.float()
    if not torch.isfinite(rewards_PG).all():
        raise ValueError("rewards_PG holds NaN or inf; every reward must be a finite number")
    if rewards_PG.shape[1] == 1:
        return torch.zeros_like(rewards_PG)
    moments = _leave_one_out_moments if leave_one_out else _group_moments
    baseline_PG, std_PG = moments(rewards_PG)
    advantages_PG = rewards_PG - baseline_PG
    if normalize:
        advantages_PG = torch.where(std_PG > 0, advantages_PG / (std_PG + eps), advantages_PG)
    # All-equal rewards can still leave a rounding residue in r - mean (0.1 * 3 / 3 != 0.1).
    no_spread_P1 = rewards_PG.amax(1, keepdim=True) == rewards_PG.amin(1, keepdim=True)
    return advantages_PG.masked_fill(no_spread_P1, 0.0)


def _group_moments(rewards_PG: Tensor) -> tuple[Tensor, Tensor]:
    """Group mean and Bessel-corrected std, broadcast to (P, G). Requires G >= 2."""
    mean_P1 = rewards_PG.mean(1, keepdim=True)
    std_P1 = rewards_PG.std(1, correction=1, keepdim=True)
    return mean_P1.expand_as(rewards_PG), std_P1.expand_as(rewards_PG)


def _leave_one_out_moments(rewards_PG: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and Bessel-corrected std of the G-1 *other* rewards, for each (p, i). G >= 2.

    Works on a (P, G, G) view where [p, i, j] is reward j as seen by generation i (j != i):
    plain elementwise sums, no matmul, so TF32 matmul settings cannot round the baseline.
    """
    num_gens = rewards_PG.shape[1]
    others_GG = ~torch.eye(num_gens, dtype=torch.bool, device=rewards_PG.device)
    rewards_P1G = rewards_PG.unsqueeze(1)
    mean_PG = torch.where(others_GG, rewards_P1G, 0.0).sum(2) / (num_gens - 1)
    centred_PGG = torch.where(others_GG, rewards_P1G - mean_PG.unsqueeze(2), 0.0)
    var_PG = centred_PGG.square().sum(2) / max(num_gens - 2, 1)
    others_max_PG = torch.where(others_GG, rewards_P1G, -torch.inf).amax(2)
    others_min_PG = torch.where(others_GG, rewards_P1G, torch.inf).amin(2)
    std_PG = torch.where(others_max_PG > others_min_PG, var_PG.sqrt(), 0.0)
    return mean_PG, std_PG


def zero_variance_groups(rewards_PG: Tensor) -> Tensor:
    """(P,) bool: groups whose G rewards are all exactly equal (zero advantage, no signal).

    DAPO's dynamic sampling drops these groups and generates more prompts to fill the batch.
    """
    if rewards_PG.dim() != 2:
        raise ValueError(f"rewards_PG must be 2-D, got shape {tuple(rewards_PG.shape)}")
    return rewards_PG.amax(1) == rewards_PG.amin(1)


def overlong_penalty(
    lengths_B: Tensor, max_new_tokens: int, buffer_tokens: int, penalty: float
) -> Tensor:
    """DAPO's soft overlong punishment (B,), <= 0, added to each rollout's reward.

    0 for completions up to max_new_tokens - buffer_tokens tokens long, then falling linearly to
    -penalty at max_new_tokens (and below that, -penalty, for anything longer):
        -penalty * clamp((len - (max_new_tokens - buffer_tokens)) / buffer_tokens, 0, 1)
    buffer_tokens = 0 gives no penalty at all (shaping off).
    """
    if buffer_tokens < 0 or buffer_tokens > max_new_tokens:
        raise ValueError(
            f"buffer_tokens must be in [0, max_new_tokens={max_new_tokens}], got {buffer_tokens}"
        )
    lengths_B = lengths_B.to(torch.float64)
    if buffer_tokens == 0:
        return torch.zeros_like(lengths_B)
    excess_B = (lengths_B - (max_new_tokens - buffer_tokens)) / buffer_tokens
    return -penalty * excess_B.clamp(0.0, 1.0)


# ---------------------------------------------------------------- importance sampling


def importance_weights(
    train_logprobs_BT: Tensor,
    gen_logprobs_BT: Tensor,
    mask_BT: Tensor,
    kind: Literal["tis", "mis"],
    cap: float,
    mask_below: float,
) -> tuple[Tensor, Tensor]:
    """Off-policy correction for a generator that disagrees with the trainer: (weights, clipped).

    The rollouts were sampled by the generator (vLLM, HF) but the loss assumes the trainer's own
    policy before this step (logp_old, recomputed). Per token w_t = exp(logp_old_t - logp_gen_t).
      tis (truncated, token level): weight_t = min(w_t, cap); `clipped` marks w_t > cap.
      mis (masked, sequence level): w_b = exp(sum_{valid t} log w_t), the sequence's likelihood
          ratio; weight = w_b on every token of b when mask_below <= w_b <= cap, else 0 (the
          sequence is left out); `clipped` marks the tokens of masked sequences.
    Weights are detached constants, 1 where trainer and generator agree exactly, and 0 on
    padding. The log-ratio is clamped to +-20 before exp (finite in fp32 and bf16).
    """
    if train_logprobs_BT.shape != gen_logprobs_BT.shape or mask_BT.shape != gen_logprobs_BT.shape:
        raise ValueError(
            f"train_logprobs {tuple(train_logprobs_BT.shape)}, gen_logprobs "
            f"{tuple(gen_logprobs_BT.shape)} and mask {tuple(mask_BT.shape)} must match"
        )
    if not cap > 0 or not 0 <= mask_below <= cap:
        raise ValueError(f"need cap > 0 and 0 <= mask_below <= cap, got {cap}, {mask_below}")
    valid_BT = mask_BT.bool()
    with torch.no_grad():
        log_w_BT = torch.where(valid_BT, train_logprobs_BT.float() - gen_logprobs_BT.float(), 0.0)
        if kind == "tis":
            w_BT = log_w_BT.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP).exp()
            clipped_BT = valid_BT & (w_BT > cap)
            weights_BT = torch.where(valid_BT, w_BT.clamp(max=cap), 0.0)
        elif kind == "mis":
            log_w_B = log_w_BT.sum(1).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
            w_B = log_w_B.exp()
            keep_B = (w_B >= mask_below) & (w_B <= cap)
            clipped_BT = valid_BT & ~keep_B.unsqueeze(1)
            weights_BT = torch.where(valid_BT & keep_B.unsqueeze(1), w_B.unsqueeze(1), 0.0)
        else:
            raise ValueError(f"unknown importance-sampling kind {kind!r}; use 'tis' or 'mis'")
    return weights_BT, clipped_BT


def importance_metrics(
    weights_BT: Tensor, clipped_BT: Tensor, mask_BT: Tensor, num_tokens: float | Tensor
) -> dict[str, Tensor]:
    """Mismatch metrics beside token_mult_prob_error: is_weight_mean (per valid token, a share
    that adds up over micro-batches given the global num_tokens), is_weight_max (reduce with
    max) and is_clipped_fraction (share of valid tokens truncated or masked)."""
    valid_BT = mask_BT.bool()
    return {
        "is_weight_mean": _masked_sum(weights_BT, valid_BT) / num_tokens,
        "is_weight_max": torch.where(valid_BT, weights_BT, 0.0).amax()
        if valid_BT.any()
        else weights_BT.new_zeros(()),
        "is_clipped_fraction": (clipped_BT & valid_BT).sum() / num_tokens,
    }


# ---------------------------------------------------------------- KL


def kl_estimate(logprobs_BT: Tensor, ref_logprobs_BT: Tensor, kind: Literal["k1", "k3"]) -> Tensor:
    """Per-token estimate (B, T) of KL(pi || pi_ref) from logprobs of tokens sampled from pi.

    With d = clamp(logp_ref - logp, -20, 20) (see KL_LOG_RATIO_CLAMP):
      k1 = -d = logp - logp_ref        unbiased, but any sign per token;
      k3 = exp(d) - d - 1              unbiased and >= 0 per token (Schulman, "Approximating
                                       KL divergence", 2020); what NeMo-RL uses by default.
    """
    if logprobs_BT.shape != ref_logprobs_BT.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs_BT.shape)} and ref_logprobs "
            f"{tuple(ref_logprobs_BT.shape)} must have the same shape"
        )
    log_ratio_BT = (ref_logprobs_BT - logprobs_BT).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    if kind == "k1":
        return -log_ratio_BT
    if kind == "k3":
        return log_ratio_BT.exp() - log_ratio_BT - 1
    raise ValueError(f"unknown KL estimator {kind!r}; use 'k1' or 'k3'")


# ---------------------------------------------------------------- loss


@dataclass(frozen=True)
class ClipTerms:
    """The loss's constants (the train loop builds it once per step from the recipe's `loss`)."""

    clip_low: float  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float
    kl_weight: float  # beta; the KL term is added only when kl_BT is given
    token_level: bool  # True: mean over all valid tokens; False: per sequence, then over them
    ratio_level: Literal["token", "sequence"]  # sequence: GSPO's one ratio per sequence


def clipped_pg_loss(
    *,
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    terms: ClipTerms,
    global_num_tokens: float | Tensor,
    global_num_seqs: float | Tensor,
    kl_BT: Tensor | None = None,
    is_weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-style clipped policy-gradient loss with a KL penalty; returns (loss, metrics).

    Every argument is a keyword (two swapped tensors or constants are a TypeError, never a
    silent wrong loss). The formulas are the header's: l_t with A the sequence's advantage and
    logp_old detached; `terms.token_level` picks the normalisation, which the KL term follows.
    global_num_tokens / global_num_seqs count valid tokens / sequences with at least one valid
    token over the whole step: every micro-batch on every data-parallel rank. Because each
    micro-batch divides by the global count, the micro-batch losses (and their gradients) sum to
    the full-batch mean: accumulate gradients with a plain sum, and all-reduce with SUM, not AVG.
    `valid_counts` gives one micro-batch's counts to add up; the counts may be Python numbers or
    0-d tensors (left on the device: no host sync).

    Metrics are detached 0-d tensors (no .item(): no host sync per micro-batch), each this
    micro-batch's share of the step value, so they too add up over micro-batches and ranks:
      loss, pg_loss, kl_loss   loss = pg_loss + kl_loss, in the loss's normalisation
                               (kl_loss includes kl_weight);
      kl                       mean raw KL estimate per valid token (token-normalised);
      ratio_mean               mean rho per valid token;
      clip_low_fraction        share of valid tokens with A < 0 and rho < 1 - clip_low;
      clip_high_fraction       share of valid tokens with A > 0 and rho > 1 + clip_high;
      clip_fraction            their sum: tokens whose clipped branch is active (zero gradient).

    ratio_level "sequence" is GSPO (rho_b, broadcast over its tokens and clipped the same way;
    GSPO's ranges are ~1e-3, not 0.2). is_weights_BT (from `importance_weights`, constant)
    multiplies the policy-gradient term per token (TIS / MIS); the KL term is not reweighted.
    None means no correction: the loss is exactly the uncorrected one.
    """
    clip_low, clip_high, ratio_level = terms.clip_low, terms.clip_high, terms.ratio_level
    _check_loss_shapes(logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, kl_BT)
    _check_positive("global_num_tokens", global_num_tokens)
    _check_positive("global_num_seqs", global_num_seqs)
    valid_BT = mask_BT.bool()
    # Padding may hold -inf logprobs: zero the log-ratio there before exp, so neither the
    # forward nor the backward pass ever sees inf.
    log_ratio_BT = torch.where(valid_BT, logprobs_BT - old_logprobs_BT.detach(), 0.0)
    if ratio_level == "sequence":
        seq_log_ratio_B = log_ratio_BT.sum(1) / valid_BT.sum(1).clamp(min=1)
        log_ratio_BT = seq_log_ratio_B.unsqueeze(1).expand_as(log_ratio_BT)
    elif ratio_level != "token":
        raise ValueError(f"unknown ratio_level {ratio_level!r}; use 'token' or 'sequence'")
    ratio_BT = log_ratio_BT.exp()
    adv_B1 = advantages_B.detach().unsqueeze(1).to(ratio_BT.dtype)
    clipped_ratio_BT = ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    pg_BT = torch.maximum(-adv_B1 * ratio_BT, -adv_B1 * clipped_ratio_BT)
    if is_weights_BT is not None:
        if is_weights_BT.shape != pg_BT.shape:
            raise ValueError(
                f"is_weights_BT has shape {tuple(is_weights_BT.shape)}, expected "
                f"{tuple(pg_BT.shape)}"
            )
        pg_BT = pg_BT * is_weights_BT.detach().to(pg_BT.dtype)
    norm = (valid_BT, terms.token_level, global_num_tokens, global_num_seqs)
    pg_loss = _normalise(pg_BT, *norm)
    kl_loss = (
        _normalise(terms.kl_weight * kl_BT, *norm) if kl_BT is not None else pg_loss.new_zeros(())
    )
    loss = pg_loss + kl_loss
    with torch.no_grad():
        clip_low_BT = valid_BT & (adv_B1 < 0) & (ratio_BT < 1 - clip_low)
        clip_high_BT = valid_BT & (adv_B1 > 0) & (ratio_BT > 1 + clip_high)
        per_token = global_num_tokens
        metrics = {
            "loss": loss.detach(),
            "pg_loss": pg_loss.detach(),
            "kl_loss": kl_loss.detach(),
            "kl": (
                _masked_sum(kl_BT, valid_BT) / per_token
                if kl_BT is not None
                else pg_loss.new_zeros(())
            ),
            "ratio_mean": _masked_sum(ratio_BT, valid_BT) / per_token,
            "clip_fraction": (clip_low_BT | clip_high_BT).sum() / per_token,
            "clip_low_fraction": clip_low_BT.sum() / per_token,
            "clip_high_fraction": clip_high_BT.sum() / per_token,
        }
    return loss, metrics


def valid_counts(mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    """(valid tokens, sequences with >= 1 valid token) in one micro-batch, as 0-d tensors.

    Sum these over the step's micro-batches and all-reduce (SUM) over data-parallel ranks to get
    clipped_pg_loss's global_num_tokens and global_num_seqs.
    """
    valid_BT = mask_BT.bool()
    return valid_BT.sum(), valid_BT.any(1).sum()


def _normalise(
    values_BT: Tensor,
    valid_BT: Tensor,
    token_level: bool,
    num_tokens: float | Tensor,
    num_seqs: float | Tensor,
) -> Tensor:
    if token_level:
        return _masked_sum(values_BT, valid_BT) / num_tokens
    seq_sum_B = torch.where(valid_BT, values_BT, 0.0).sum(1)
    seq_mean_B = seq_sum_B / valid_BT.sum(1).clamp(min=1)  # a sequence with no tokens adds 0
    return seq_mean_B.sum() / num_seqs


def _masked_sum(values: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, values, 0.0).sum()


def _check_loss_shapes(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    kl_BT: Tensor | None,
) -> None:
    shape = tuple(logprobs_BT.shape)
    if len(shape) != 2:
        raise ValueError(f"logprobs_BT must be 2-D (batch x tokens), got shape {shape}")
    named = {"old_logprobs_BT": old_logprobs_BT, "mask_BT": mask_BT, "kl_BT": kl_BT}
    for name, tensor in named.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
    if tuple(advantages_B.shape) != shape[:1]:
        raise ValueError(
            f"advantages_B has shape {tuple(advantages_B.shape)}, expected {shape[:1]} "
            "(one advantage per sequence)"
        )


def _check_positive(name: str, value: float | Tensor) -> None:
    # Only Python numbers are checked: comparing a device tensor would force a host sync.
    if isinstance(value, int | float) and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}; count it over the whole step")


# ---------------------------------------------------------------- logits and logprobs


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over entries where mask != 0 (over `dim`, or everything); 0 where none is valid."""
    valid = mask.bool().expand_as(x)
    total = torch.where(valid, x, 0.0)
    if dim is None:
        return total.sum() / valid.sum().clamp(min=1)
    return total.sum(dim) / valid.sum(dim).clamp(min=1)


def token_logprobs(logits_BTV: Tensor, tokens_BT: Tensor) -> Tensor:
    """log softmax(logits)[token] in fp32, (B, T). logits_BTV[b, t] must predict tokens_BT[b, t].

    The caller aligns them (logits at position t predict the token at t + 1). Computed as
    logit[token] - logsumexp(logits), which equals the gathered log_softmax without
    materialising a second (B, T, V) tensor.
    """
    if logits_BTV.dim() != 3 or logits_BTV.shape[:2] != tokens_BT.shape:
        raise ValueError(
            f"logits_BTV {tuple(logits_BTV.shape)} must be (B, T, V) with (B, T) equal to "
            f"tokens_BT {tuple(tokens_BT.shape)}"
        )
    logits_BTV = logits_BTV.float()
    picked_BT = logits_BTV.gather(2, tokens_BT.long().unsqueeze(2)).squeeze(2)
    return picked_BT - torch.logsumexp(logits_BTV, dim=2)


def token_mult_prob_error(
    gen_logprobs_BT: Tensor,
    train_logprobs_BT: Tensor,
    mask_BT: Tensor,
    num_tokens: float | Tensor | None = None,
) -> Tensor:
    """Mean over valid tokens of exp(|logp_generator - logp_trainer|) (NeMo-RL's metric).

    1.0 means the generator and the trainer agree exactly; 1.01 means probabilities differ by
    about 1% per token. Pass num_tokens (the global count) to divide by it instead of this
    call's own count, so values from micro-batches or ranks add up.
    """
    valid_BT = mask_BT.bool()
    gap_BT = torch.where(valid_BT, gen_logprobs_BT - train_logprobs_BT, 0.0).abs()
    error_sum = _masked_sum(gap_BT.exp(), valid_BT)
    return error_sum / (num_tokens if num_tokens is not None else valid_BT.sum().clamp(min=1))
