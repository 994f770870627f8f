"""Generated data: random tokens for speed and memory; a learnable task with a known best loss.

The learnable task is a random sparse Markov chain over ``n_states`` tokens. Each token has
``branching`` possible successors with random probabilities, so the best a causal language
model can do is predict the successor distribution of the current token. Its expected loss
per token is the chain's entropy rate  H = sum_i pi_i * H(T_i)  (pi the stationary
distribution, T_i the i-th row), which we compute exactly. A model that learns the task
drives its loss from about log(n_states) towards H, and "converged" can be checked against
a number instead of a picture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class MarkovTask:
    """A random sparse Markov chain; ``entropy_rate`` is the best achievable loss in nats/token."""

    n_states: int = 64
    branching: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        n, k = self.n_states, self.branching
        # Each row: k distinct successors, probabilities from a flat Dirichlet (exponentials / sum).
        succ = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(n)])  # (n, k)
        w = -torch.log(torch.rand(n, k, generator=g, dtype=torch.float64))  # Exp(1) draws
        self.transition = torch.zeros(n, n, dtype=torch.float64)  # (n, n), rows sum to 1
        self.transition.scatter_(1, succ, w / w.sum(1, keepdim=True))
        # Stationary distribution: the leading left eigenvector, found by power iteration on a
        # lazy chain (0.5 I + 0.5 T has the same stationary vector and cannot oscillate).
        lazy = 0.5 * torch.eye(n, dtype=torch.float64) + 0.5 * self.transition
        pi = torch.full((n,), 1.0 / n, dtype=torch.float64)
        for _ in range(10_000):
            nxt = pi @ lazy
            if torch.allclose(nxt, pi, atol=1e-14, rtol=0):
                break
            pi = nxt
        self.stationary = pi / pi.sum()

    @property
    def entropy_rate(self) -> float:
        """Best achievable mean cross-entropy (nats/token) for next-token prediction."""
        t = self.transition
        row_h = -(t * torch.where(t > 0, t.log(), torch.zeros_like(t))).sum(1)  # (n,)
        return float(self.stationary @ row_h)

    @property
    def uniform_loss(self) -> float:
        """Loss of a model that has learnt nothing beyond the token range: log(n_states)."""
        return math.log(self.n_states)

    def sample(self, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """Token ids of shape (batch, seq_len), each row a walk started from the stationary law."""
        out = torch.empty(batch, seq_len, dtype=torch.long)
        out[:, 0] = torch.multinomial(self.stationary.float(), batch, True, generator=generator)
        probs = self.transition.float()
        for t in range(1, seq_len):
            out[:, t] = torch.multinomial(probs[out[:, t - 1]], 1, generator=generator)[:, 0]
        return out


def random_batch(
    kind: str, batch: int, seq_len: int, vocab_size: int, num_labels: int = 2, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Uniform random tokens for speed/memory runs; labels for ``kind`` (causal-lm | classify)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=g)  # (B, S)
    if kind == "causal-lm":
        return {"input_ids": ids, "labels": ids.clone()}  # HF shifts labels inside the model
    return {"input_ids": ids, "labels": torch.randint(0, num_labels, (batch,), generator=g)}


def markov_batch(
    task: MarkovTask, kind: str, batch: int, seq_len: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A batch of the learnable task for ``kind``: causal-lm predicts the walk; classify tells
    whether the walk was reversed in time (label 1) or not (label 0)."""
    ids = task.sample(batch, seq_len, generator)  # (B, S)
    if kind == "causal-lm":
        return {"input_ids": ids, "labels": ids.clone()}
    flip = torch.randint(0, 2, (batch,), generator=generator)  # (B,)
    ids = torch.where(flip[:, None].bool(), ids.flip(1), ids)
    return {"input_ids": ids, "labels": flip}


def markov_dataset(task: MarkovTask, kind: str, n: int, seq_len: int, seed: int = 0):
    """The learnable task as a ``datasets.Dataset`` (for the Trainer), generated locally."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    data = markov_batch(task, kind, n, seq_len, g)
    return Dataset.from_dict({k: v.tolist() for k, v in data.items()}).with_format("torch")
