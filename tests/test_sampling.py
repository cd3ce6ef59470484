"""The per-request sampler: exact greedy, the same distribution as `generate`'s warpers, seeds."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from engine.sampling import choose_tokens, seeded_uniform


def _reference_probs(logits, temperature, top_k, top_p):
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)[0]


def _empirical(logits, temperature, top_k, top_p, draws=4000):
    rows = logits.expand(draws, -1)
    uniform = torch.tensor([seeded_uniform(7, i) for i in range(draws)], dtype=torch.float32)
    tokens = choose_tokens(rows, torch.full((draws,), temperature), torch.full((draws,), top_k, dtype=torch.int32),
                           torch.full((draws,), top_p), uniform)
    return torch.bincount(tokens[:, 0], minlength=logits.size(-1)).float() / draws


def test_distribution_matches_generate_warpers():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.7)]:
        expected = _reference_probs(logits, temperature, top_k, top_p)
        observed = _empirical(logits, temperature, top_k, top_p)
        assert torch.allclose(observed, expected, atol=0.03), (temperature, top_k, top_p, observed, expected)
        assert (observed[expected == 0] == 0).all()  # filtered tokens are never drawn


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    torch.manual_seed(1)
    scores = torch.randn(4, 50)
    tokens = choose_tokens(scores, torch.tensor([0.0, 1.0, 0.0, 2.0]), torch.zeros(4, dtype=torch.int32),
                           torch.ones(4), torch.tensor([0.99, 0.5, 0.01, 0.3]))
    assert tokens[0, 0] == scores[0].argmax() and tokens[2, 0] == scores[2].argmax()


def test_seeded_uniform_is_stable_and_spread():
    values = [seeded_uniform(42, i) for i in range(1000)]
    assert values == [seeded_uniform(42, i) for i in range(1000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.05
    assert seeded_uniform(1, 0) != seeded_uniform(2, 0)


def test_an_all_greedy_step_skips_the_sort_unless_captured_in_a_cuda_graph(monkeypatch, engine):
    from engine import sampling

    scores = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]])
    sorted_calls = []
    monkeypatch.setattr(sampling, "choose_tokens", lambda *args: sorted_calls.append(1) or args[0].argmax(-1, True))
    for captured in (False, True):
        step = sampling._StepValues(temperature=torch.zeros(2).view(torch.int32), top_k=torch.zeros(2, dtype=torch.int32),
                                    top_p=torch.ones(2).view(torch.int32), all_greedy=True, graph_captured=captured)
        one_hot = sampling._SampleColumn(step)(scores, torch.zeros(2).view(torch.int32))
        assert one_hot.argmax(-1).tolist() == [1, 0] and torch.isinf(one_hot).sum() == 4
        assert len(sorted_calls) == int(captured)  # a graph replays the full, branch-free sampler
    # The engine's own manager: CPU steps are never captured, so greedy steps take the shortcut.
    sampler = engine._manager.logit_processor.logits_processor[-1]
    assert sampler.step.graph_captured is False
