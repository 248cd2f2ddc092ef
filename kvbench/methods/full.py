"""Full cache: keeps every token; the reference every other method is compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from torch import Tensor

from kvbench.kv import AttentionStats, HostSizes, LayerKV
from kvbench.methods.base import Method


@dataclass
class Full(Method):
    name: ClassVar[str] = "full"

    def compress(self, layer: int, kv: LayerKV, stats: AttentionStats, n_keep: Tensor, phase: str,
                 host: HostSizes | None = None) -> LayerKV:
        return kv

    def kept_lengths(self, layer: int, host: HostSizes) -> np.ndarray:
        return host.lengths
