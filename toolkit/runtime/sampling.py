"""Token choice: greedy, or temperature sampling from a seeded generator."""

from __future__ import annotations

import torch


class Sampler:
    """Picks one token per row of logits. Greedy at temperature 0, else softmax(logits / T) sampling."""

    def __init__(self, temperature: float = 0.0, seed: int = 0):
        self.temperature = temperature
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> list[int]:
        logits = logits.float().reshape(-1, logits.shape[-1]).cpu()
        if self.temperature <= 0:
            return logits.argmax(-1).tolist()
        probs = torch.softmax(logits / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=self.gen).squeeze(-1).tolist()
