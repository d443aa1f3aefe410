"""What a timing run measures: the variants and the (N, B, K) shapes, as plain data.

Shapes: N ads, B requests, K results.

No torch here: the command line builds its help and checks its arguments from these names, and
`m31 --help` should not wait for PyTorch to import.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# kernel, kernel-int8 and kernel-int8-torch: `m31.bench.kernels`; the rest: `m31.bench.baselines`.
VARIANTS = (
    "kernel",
    "kernel-int8",
    "kernel-int8-torch",
    "reference",
    "eager",
    "compile",
    "two-tower",
    "faiss",
)
_BF16 = tuple(v for v in VARIANTS if not v.startswith("kernel-int8"))
# DESIGN §6: N in {1 M, 10 M, 100 M}, B in {1, 64, 512}, K in {100, 1000}; (N, Bs, Ks, variants)
CANONICAL: tuple[tuple[int, tuple[int, ...], tuple[int, ...], tuple[str, ...]], ...] = (
    (10_000_000, (1, 64, 512), (100, 1000), _BF16),
    (10_000_000, (1, 64), (100, 1000), ("kernel-int8",)),
    (1_000_000, (64,), (100,), _BF16),
    (100_000_000, (64,), (100,), _BF16),
)


@dataclass(frozen=True)
class Case:
    n: int
    b: int
    k: int
    variant: str


def plan_cases(
    ns: Iterable[int], batches: Iterable[int], ks: Iterable[int], variants: Iterable[str]
) -> list[Case]:
    return [Case(n, b, k, v) for n in ns for b in batches for k in ks for v in variants]


def canonical_cases(variants: Iterable[str] = VARIANTS) -> list[Case]:
    keep = set(variants)
    return [
        c
        for n, bs, ks, vs in CANONICAL
        for c in plan_cases([n], bs, ks, [v for v in vs if v in keep])
    ]
