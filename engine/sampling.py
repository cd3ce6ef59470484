"""Per-request sampling inside transformers' continuous batching: greedy, temperature, top-k, top-p and seeds.

CB picks `do_sample` once for the whole manager and offers per-request temperature/top-k/top-p only through its own
processors, which sort the vocabulary twice per step and cannot do exact greedy or a per-request seed. So the engine
runs the manager with `do_sample=False` (argmax) and installs one sampler of its own in CB's logits-processor list:
it picks each row's token itself and hands CB a one-hot score row, which CB's argmax then takes.

- temperature 0 is exact greedy: the argmax of the raw logits, as `model.generate` computes it;
- otherwise temperature, then top-k, then top-p (renormalised after top-k, as in `generate`), then inverse-CDF
  sampling with a uniform number drawn on the host: from a per-request seed and the token position when the request
  has a seed (the same answer whatever else shares the batch), else from the engine's random generator.

CB hands each processor one int32 value per row, so the four per-row values travel as four "columns" (processor
objects); the last column runs the sampler. Nothing here branches on device data, so it is CUDA-graph safe; when
the step is not captured in a graph (CPU, MPS, CUDA with graphs off) it skips the vocabulary sort when every row
in the step is greedy, a branch on host values that a graph replay could not follow.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor
from transformers.generation.logits_process import LogitsProcessorList

# What a request passes to CB's add_request (types are checked by CB: a Python int where a float is expected fails).
SAMPLER_KWARGS: dict[str, type] = {"temperature": float, "top_k": int, "top_p": float, "seed": int}
_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) from (seed, token position): splitmix64, stable across runs and machines."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def sampling_kwargs(temperature: float, top_k: int, top_p: float, seed: int | None) -> dict:
    """The per-request kwargs for CB's add_request, with the exact types CB checks."""
    kwargs = {"temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p)}
    if seed is not None:
        kwargs["seed"] = int(seed)
    return kwargs


def _as_int32(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32)


@dataclass
class _StepValues:
    """The current step's per-row values, shared by the four columns (filled in call order)."""

    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    all_greedy: bool = False
    rng: random.Random = field(default_factory=random.Random)
    graph_captured: bool = False  # the step runs in a CUDA graph: no branching on host values


class _Column(ContinuousBatchingLogitsProcessor):
    """Carries one per-request value to the device. Subclasses say which and how it is encoded."""

    key: str
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, step: _StepValues) -> None:
        self.step = step
        self.supported_kwargs = {key: SAMPLER_KWARGS[key] for key in self.owned_keys()}

    def owned_keys(self) -> tuple[str, ...]:
        return (self.key,)

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.zero_()

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        setattr(self.step, self.key, tensor_arg[: scores.size(0)])
        return scores


class _TemperatureColumn(_Column):
    key = "temperature"

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        temperatures = [float(r.state.logit_processor_kwargs.get("temperature", 0.0)) for r in requests_with_new_token]
        self.step.all_greedy = all(t <= 0.0 for t in temperatures)
        return _as_int32(temperatures)


class _TopKColumn(_Column):
    key = "top_k"

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        return torch.tensor([int(r.state.logit_processor_kwargs.get("top_k", 0)) for r in requests_with_new_token],
                            dtype=torch.int32)


class _TopPColumn(_Column):
    key = "top_p"

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        return _as_int32([float(r.state.logit_processor_kwargs.get("top_p", 1.0)) for r in requests_with_new_token])


class _SampleColumn(_Column):
    """Carries the uniform number of each row and picks the tokens."""

    key = "seed"

    def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
        uniforms = []
        for request in requests_with_new_token:
            seed = request.state.logit_processor_kwargs.get("seed")
            if seed is None:
                uniforms.append(self.step.rng.random())
            else:
                uniforms.append(seeded_uniform(seed, request.state.generated_len()))
        return _as_int32(uniforms)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        rows = scores.size(0)
        step = self.step
        if step.all_greedy and not step.graph_captured:  # a captured graph must not depend on this host branch
            chosen = scores.argmax(dim=-1, keepdim=True)  # no vocabulary sort: a greedy step costs one argmax
        else:
            chosen = choose_tokens(scores, step.temperature.view(torch.float32), step.top_k,
                                   step.top_p.view(torch.float32), tensor_arg[:rows].view(torch.float32))
        return torch.full_like(scores, float("-inf")).scatter_(-1, chosen, 0.0)


def choose_tokens(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  uniform: torch.Tensor) -> torch.Tensor:
    """Pick one token per row of `scores` [rows, vocab]: argmax where temperature <= 0, else temperature, top-k
    (0 = off), top-p (renormalised after top-k) and inverse-CDF sampling at `uniform` in [0, 1). Returns [rows, 1]."""
    greedy = temperature <= 0
    greedy_tokens = scores.argmax(dim=-1, keepdim=True)
    logits = scores / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    vocab = scores.size(-1)
    ranks = torch.arange(vocab, device=scores.device).unsqueeze(0)
    top_k = top_k.to(torch.int64)
    top_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # renormalised over the top-k, as generate's top-p sees them
    cumulative = probs.cumsum(dim=-1)
    keep = (cumulative - probs) < top_p.unsqueeze(-1)
    kept = probs * keep
    cumulative_kept = kept.cumsum(dim=-1)
    target = uniform.unsqueeze(-1) * cumulative_kept[:, -1:]
    position = torch.searchsorted(cumulative_kept, target, right=True)
    position = torch.minimum(position, keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    sampled = sorted_index.gather(-1, position)
    return torch.where(greedy.unsqueeze(-1), greedy_tokens, sampled)


def install_sampler(manager, seed: int | None = None) -> None:
    """Replace the manager's logits processors with the per-request sampler. Call before `start()`."""
    # The manager's config is resolved at construction: whether its steps are captured in CUDA graphs is known.
    graphs = any(manager.continuous_batching_config.cuda_graph_booleans)
    step = _StepValues(rng=random.Random(seed), graph_captured=graphs)
    columns = [_TemperatureColumn(step), _TopKColumn(step), _TopPColumn(step), _SampleColumn(step)]
    processors = manager.logit_processor
    processors.logits_processor = LogitsProcessorList(columns)
    processors.tensors_required = len(columns)
    processors.do_processing = True
    processors._retrieve_processors_kwargs()

