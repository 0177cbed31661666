"""Local backend losses: gradients match hand-computed and finite-difference references."""

from __future__ import annotations

import pytest
import torch

from torchkit.losses import forward_kl, full_kl, kl_penalty, per_token_loss, token_weights

LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo"]


def categorical_logp(logits_V: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits_V, -1)[tokens]


@pytest.mark.parametrize("loss", LOSSES)
def test_loss_gradient_matches_finite_differences(loss: str) -> None:
    torch.manual_seed(0)
    tokens, adv_T = [0, 2, 1, 2], torch.tensor([1.5, -0.5, 0.3, 2.0], dtype=torch.float64)
    theta = torch.randn(5, dtype=torch.float64)
    old_T = categorical_logp(theta + 0.05 * torch.randn(5, dtype=torch.float64), tokens)

    # CISPO's importance weight is a constant of the gradient (stop-gradient): hold it fixed.
    weight_T = torch.exp(categorical_logp(theta, tokens) - old_T).clamp(0.8, 1.2)

    def objective(params: torch.Tensor) -> torch.Tensor:
        logp = categorical_logp(params, tokens)
        if loss == "cispo":
            return -(weight_T * adv_T * logp).sum()
        return per_token_loss(loss, logp, old_T, adv_T, clip_ratio=0.2).loss_T.sum()

    def autograd_objective(params: torch.Tensor) -> torch.Tensor:
        logp = categorical_logp(params, tokens)
        return per_token_loss(loss, logp, old_T, adv_T, clip_ratio=0.2).loss_T.sum()

    params = theta.clone().requires_grad_(True)
    autograd_objective(params).backward()
    assert params.grad is not None
    eps = 1e-6
    for i in range(5):
        bump = torch.zeros(5, dtype=torch.float64)
        bump[i] = eps
        numeric = (objective(theta + bump) - objective(theta - bump)) / (2 * eps)
        assert params.grad[i].item() == pytest.approx(numeric.item(), abs=1e-6), f"d/dtheta{i}"


def test_importance_sampling_gradient_is_the_hand_computed_policy_gradient() -> None:
    theta = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64, requires_grad=True)
    logp = categorical_logp(theta, [1])
    terms = per_token_loss("importance_sampling", logp, logp.detach(), torch.tensor([2.0]))
    terms.loss_T.sum().backward()
    probs = torch.softmax(theta.detach(), -1)
    expected = -2.0 * (torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64) - probs)
    assert theta.grad is not None
    torch.testing.assert_close(theta.grad, expected)


def test_ppo_at_ratio_one_equals_importance_sampling() -> None:
    torch.manual_seed(1)
    grads = {}
    for loss in ("ppo", "importance_sampling"):
        theta = torch.randn(6, generator=torch.Generator().manual_seed(3), requires_grad=True)
        logp = categorical_logp(theta, [0, 3, 5])
        adv = torch.tensor([1.0, -2.0, 0.5])
        terms = per_token_loss(loss, logp, logp.detach(), adv)
        terms.loss_T.sum().backward()
        grads[loss] = (terms.loss_T.detach(), theta.grad)
    torch.testing.assert_close(grads["ppo"][0], grads["importance_sampling"][0])
    torch.testing.assert_close(grads["ppo"][1], grads["importance_sampling"][1])


def test_ppo_clips_a_ratio_outside_the_trust_region() -> None:
    logp = torch.tensor([0.0], requires_grad=True)
    old = torch.tensor([-1.0])  # ratio e ~ 2.7 > 1.2
    terms = per_token_loss("ppo", logp, old, torch.tensor([1.0]), clip_ratio=0.2)
    terms.loss_T.sum().backward()
    assert terms.clipped_T.all() and logp.grad is not None and logp.grad.item() == 0.0


def test_token_weights_aggregate_by_tokens_or_sequences() -> None:
    weights, norm = token_weights([2, 3], "token_mean")
    assert weights.tolist() == [1, 1, 1, 1, 1] and norm == 5
    weights, norm = token_weights([2, 4], "seq_mean_token_mean")
    assert weights.tolist() == [0.5, 0.5, 0.25, 0.25, 0.25, 0.25] and norm == 2


def test_the_model_calls_of_one_trajectory_aggregate_as_one_sequence() -> None:
    # A trajectory of two calls (2 + 2 tokens) and one of a single call (4 tokens).
    weights, norm = token_weights([2, 2, 4], "seq_mean_token_mean", sequences=[0, 0, 1])
    assert weights.tolist() == [0.25] * 8 and norm == 2, "each trajectory weighs 1 in all"
    weights, norm = token_weights([2, 2, 4], "seq_mean_token_sum", sequences=[0, 0, 1])
    assert weights.tolist() == [1.0] * 8 and norm == 2, "normalised by trajectories, not calls"
    weights, norm = token_weights([2, 2, 4], "token_mean", sequences=[0, 0, 1])
    assert weights.tolist() == [1.0] * 8 and norm == 8


def test_per_trajectory_weights_cancel_a_groups_advantages_however_long_its_episodes() -> None:
    # A solved episode ends after one call, a failed one runs three: with advantages +1 and -1
    # the trajectory weighting nets zero, the token mean pushes down on balance.
    lengths, sequences, advantages = [10, 10, 10, 10], [0, 1, 1, 1], [1.0, -1.0, -1.0, -1.0]
    per_token = torch.tensor(
        [a for a, n in zip(advantages, lengths, strict=True) for _ in range(n)]
    )
    weights, _ = token_weights(lengths, "seq_mean_token_mean", sequences)
    assert float((weights * per_token).sum()) == pytest.approx(0.0, abs=1e-6)
    weights, _ = token_weights(lengths, "token_mean", sequences)
    assert float((weights * per_token).sum()) == -20.0


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo"])
def test_truncated_is_gives_every_policy_loss_the_capped_policy_gradient(loss: str) -> None:
    theta = torch.tensor([0.3, -0.2, 0.5, 0.0], dtype=torch.float64, requires_grad=True)
    tokens, adv_T = [0, 1, 2, 3], torch.tensor([1.0, -2.0, 0.5, 1.5], dtype=torch.float64)
    logp_T = categorical_logp(theta, tokens)
    # Mixed versions: stale tokens the sampler found less likely (ratio 4 and 2.5, over the cap
    # of 2), and fresher ones (ratio 1.2 and 0.7).
    ratio_T = torch.tensor([4.0, 2.5, 1.2, 0.7], dtype=torch.float64)
    old_T = logp_T.detach() - ratio_T.log()
    terms = per_token_loss(loss, logp_T, old_T, adv_T, clip_ratio=0.2, tis_cap=2.0)
    terms.loss_T.sum().backward()

    weight_T = ratio_T.clamp(max=2.0)
    assert terms.is_weight_T is not None and terms.is_capped_T is not None
    torch.testing.assert_close(terms.is_weight_T, weight_T)
    assert terms.is_capped_T.tolist() == [True, True, False, False]
    torch.testing.assert_close(terms.ratio_T, ratio_T, msg="ratio_T stays trainer over sampler")
    expected = torch.autograd.grad(
        -(weight_T * adv_T * categorical_logp(theta, tokens)).sum(), theta
    )
    assert theta.grad is not None
    torch.testing.assert_close(theta.grad, expected[0])
    assert not terms.clipped_T.any(), "the ratio to the proximal policy is 1: nothing clipped"


def test_without_tis_cap_the_loss_is_unchanged() -> None:
    logp_T = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    old_T, adv_T = torch.tensor([-1.5, -1.0], dtype=torch.float64), torch.tensor([1.0, -1.0])
    terms = per_token_loss("ppo", logp_T, old_T, adv_T.double())
    assert terms.is_weight_T is None and terms.is_capped_T is None
    ratio_T = (logp_T - old_T).exp()
    expected = -torch.minimum(ratio_T * adv_T, ratio_T.clamp(0.8, 1.2) * adv_T)
    torch.testing.assert_close(terms.loss_T, expected)


def test_full_kl_is_the_exact_kl_that_k3_estimates_from_samples() -> None:
    torch.manual_seed(0)
    logits, ref_logits = torch.randn(3, 7), torch.randn(3, 7)
    p, ref = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    exact = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=p), torch.distributions.Categorical(logits=ref)
    )
    torch.testing.assert_close(full_kl(p, ref), exact)
    assert torch.all(full_kl(p, p) == 0)
    samples = torch.distributions.Categorical(logits=p).sample((200_000,))  # [N, 3]
    picked = p.gather(1, samples.T).T, ref.gather(1, samples.T).T
    torch.testing.assert_close(kl_penalty(*picked).mean(0), exact, rtol=0.05, atol=1e-3)
    assert torch.all(full_kl(p, ref, clamp=0.01) <= 0.01)


def test_forward_kl_is_exact_and_its_gradient_is_the_one_k3_follows_on_average() -> None:
    """k3 in the loss, on tokens the policy samples, pulls each by (ref/p - 1) grad log p: on
    average the gradient of KL(ref || p), which `forward_kl` computes exactly (logits: p - ref)."""
    torch.manual_seed(0)
    logits, ref_logits = torch.randn(3, 7, requires_grad=True), torch.randn(3, 7)
    p, ref = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    exact = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=ref), torch.distributions.Categorical(logits=p)
    )
    torch.testing.assert_close(forward_kl(p, ref), exact)
    assert torch.all(forward_kl(ref, ref) == 0)
    assert torch.all(forward_kl(p, ref, clamp=0.01) <= 0.01)
    (grad,) = torch.autograd.grad(forward_kl(p, ref).sum(), logits, retain_graph=True)
    torch.testing.assert_close(grad, p.exp() - ref.exp())
    samples = torch.distributions.Categorical(logits=p.detach()).sample((200_000,))  # [N, 3]
    picked = p.gather(1, samples.T), ref.gather(1, samples.T)  # [3, N]
    (k3_grad,) = torch.autograd.grad(kl_penalty(*picked).mean(1).sum(), logits)
    torch.testing.assert_close(k3_grad, grad, rtol=0.05, atol=5e-3)


def test_full_kl_sees_mass_moved_onto_a_token_never_sampled() -> None:
    """A policy that keeps its sampled token's probability but moves mass between two rare
    tokens: k3 on the sampled token sees nothing, the full KL sees the move."""
    ref = torch.tensor([[0.9, 0.09, 0.01]]).log()
    p = torch.tensor([[0.9, 0.01, 0.09]]).log()
    sampled = torch.tensor([[0]])
    assert kl_penalty(p.gather(1, sampled)[:, 0], ref.gather(1, sampled)[:, 0]).item() == 0
    assert full_kl(p, ref).item() > 0.1
