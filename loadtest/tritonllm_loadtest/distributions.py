"""Integer distributions for prompt lengths and max_tokens, written as short specs on the command line.

``fixed:128``, ``uniform:64,256`` (inclusive) or ``normal:128,32`` (rounded, clipped to [1, mean + 4 std]).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("fixed", "uniform", "normal")


@dataclass(frozen=True)
class IntDistribution:
    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"distribution kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "fixed" and (self.a < 1 or self.a != int(self.a)):
            raise ValueError(f"fixed:N needs an integer N >= 1, got {self.a}")
        if self.kind == "uniform" and not (1 <= self.a <= self.b):
            raise ValueError(f"uniform:LO,HI needs 1 <= LO <= HI, got {self.a},{self.b}")
        if self.kind == "normal" and (self.a < 1 or self.b < 0):
            raise ValueError(f"normal:MEAN,STD needs MEAN >= 1 and STD >= 0, got {self.a},{self.b}")

    @classmethod
    def parse(cls, spec: str) -> IntDistribution:
        kind, _, params = spec.partition(":")
        try:
            values = [float(v) for v in params.split(",")] if params else []
        except ValueError:
            raise ValueError(f"bad distribution {spec!r}: parameters must be numbers") from None
        wanted = {"fixed": 1, "uniform": 2, "normal": 2}.get(kind)
        if wanted is None or len(values) != wanted:
            raise ValueError(f"bad distribution {spec!r}: use fixed:N, uniform:LO,HI or normal:MEAN,STD")
        return cls(kind, *values)

    @property
    def upper_bound(self) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(self.b)
        return int(round(self.a + 4 * self.b))

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return min(max(1, round(rng.gauss(self.a, self.b))), self.upper_bound)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        return f"{self.kind}:{self.a:g},{self.b:g}"
