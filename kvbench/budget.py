"""Budget semantics: the user's unit (fraction or tokens per head) -> ``n_keep`` tokens per head per sample."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvbench.errors import ConfigError

KINDS = ("fraction", "tokens")


@dataclass(frozen=True)
class Budget:
    """kind="fraction": keep ``value`` (0, 1] of the basis length (prompt, or prompt + max new tokens for
    methods whose papers define it so); kind="tokens": keep ``value`` slots per head (an int > 0)."""

    kind: str
    value: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"unknown budget kind '{self.kind}'; accepted: {', '.join(KINDS)}")
        if self.kind == "fraction" and not 0 < self.value <= 1:
            raise ConfigError(f"budget fraction {self.value} is outside (0, 1]")
        if self.kind == "tokens" and (self.value <= 0 or int(self.value) != self.value):
            raise ConfigError(f"budget tokens {self.value} must be a positive integer")

    @property
    def label(self) -> str:
        if self.kind == "tokens":
            return f"tokens{int(self.value)}"
        text = f"{self.value:g}"
        return text if "." in text else f"{text}.0"  # 1.0 -> "1.0", the name of conf/budget/1.0.yaml

    def n_keep(self, prompt_lengths: Tensor, max_new_tokens: int, basis: str) -> Tensor:
        """(B,) prompt lengths -> (B,) tokens to keep per head. Fractions round half up, at least 1 token."""
        if self.kind == "tokens":
            return torch.full_like(prompt_lengths, int(self.value))
        if basis == "prompt":
            base = prompt_lengths
        elif basis == "prompt_plus_generation":
            base = prompt_lengths + max_new_tokens
        else:
            raise ConfigError(f"unknown budget basis '{basis}'; accepted: prompt, prompt_plus_generation")
        return torch.tensor([max(1, math.floor(self.value * int(n) + 0.5)) for n in base], dtype=torch.long)
