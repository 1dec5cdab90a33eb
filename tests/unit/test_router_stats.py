"""Router health metrics on hand-made counts, and the monitor's hooks on a toy router."""

from __future__ import annotations

import pytest
import torch

from megarl.actor.router_stats import RouterMonitor, router_metrics


def test_balanced_routing_scores_one_and_collapse_scores_experts_over_k():
    # 4 experts, top-2, 8 tokens: 16 routing slots
    balanced = torch.tensor([[4.0, 4.0, 4.0, 4.0]])
    uniform_probs = torch.full((1, 4), 8 * 0.25)
    m = router_metrics(balanced, uniform_probs, top_k=2)
    assert m["actor/moe_load_imbalance"] == pytest.approx(1.0)
    # Switch: E / (k T^2) * sum_e P_e f_e = 4 / (2 * 64) * 4 * (2 * 4) = 1
    assert m["actor/moe_aux_loss"] == pytest.approx(1.0)

    collapsed = torch.tensor([[8.0, 8.0, 0.0, 0.0]])  # every token to experts 0 and 1
    peaked = torch.tensor([[8 * 0.5, 8 * 0.5, 0.0, 0.0]])
    m = router_metrics(collapsed, peaked, top_k=2)
    assert m["actor/moe_load_imbalance"] == pytest.approx(2.0)  # = E / k
    assert m["actor/moe_aux_loss"] == pytest.approx(4 / (2 * 64) * (4 * 8 + 4 * 8))


def test_worst_layer_sets_the_imbalance_and_the_loss_is_a_layer_mean():
    counts = torch.tensor([[4.0, 4.0, 4.0, 4.0], [10.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    probs = torch.full((3, 4), 2.0)
    m = router_metrics(counts, probs, top_k=2)
    assert m["actor/moe_load_imbalance"] == pytest.approx(10 / 4)
    assert m["actor/moe_aux_loss"] == pytest.approx(1.0)  # uniform probs: 1 whatever the counts
    assert router_metrics(torch.zeros(2, 4), torch.zeros(2, 4), top_k=2) == {}


class _Router(torch.nn.Module):
    """Megatron's TopKRouter's interface: ``(probs, routing_map)`` from the hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
        self.layer_number = 3  # Megatron's global, 1-based: layer 2 of the model

    def forward(self, hidden):
        logits = hidden.reshape(-1, 2) @ self.weight.T
        top = logits.topk(2, dim=-1).indices
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
        return torch.softmax(logits, -1) * routing_map, routing_map


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.router = _Router()


def test_monitor_counts_only_while_watching_and_restarts_from_zero():
    model = _Block()
    monitor = RouterMonitor([model], num_experts=3, top_k=2)
    hidden = torch.tensor([[[5.0, 1.0]], [[1.0, 5.0]], [[5.0, 4.0]]])  # [seq, batch, hidden]
    model.mlp.router(hidden)  # not watched
    with monitor.watch():
        model.mlp.router(hidden)
    model.mlp.router(hidden)  # hooks removed
    counts, probs = monitor.local_counts()
    assert counts.tolist() == [[3.0, 3.0, 0.0]]
    expected = torch.softmax(hidden.reshape(-1, 2) @ model.mlp.router.weight.T, -1).sum(0)
    assert torch.allclose(probs[0], expected.double())
    placed = monitor.model_counts(num_layers=4)  # the other layers are other stages'
    assert placed.shape == (2, 4, 3)
    assert torch.equal(placed[:, 2], monitor.local_counts()[:, 0])
    assert placed[:, [0, 1, 3]].abs().sum() == 0
    with monitor.watch():
        pass
    assert monitor.local_counts().sum() == 0
