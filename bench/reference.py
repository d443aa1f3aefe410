"""Throughput of the plain PyTorch score_topk reference (the baseline every kernel is held to).

    python bench/reference.py [--n 1000000] [--batches 1,64] [--k 100] [--device cpu]

Prints a table of median time, ads/s and pairs/s for the DESIGN §6 shape E = 8, G = D = 64,
a bf16 ad table, half the ads eligible, and a torch matmul + topk two-tower baseline measured in
the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from m31.ops import score_topk


def timed(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    n, e, d, dev = args.n, args.experts, args.dim, args.device
    table = tuple(
        t.to(dev, torch.bfloat16)
        for t in (
            torch.randn(n, d, generator=gen),
            torch.randn(n, d, generator=gen),
            torch.randn(n, generator=gen),
        )
    )
    mask = (torch.rand(n, generator=gen) < 0.5).to(dev)
    print(
        f"score_topk reference, N = {n:,}, E = {e}, G = D = {d}, K = {args.k}, bf16 table, half eligible, {dev}"
    )
    print(f"{'what':<34} {'B':>4} {'median s':>9} {'ads/s':>10} {'pairs/s':>10}")
    for b in (int(s) for s in args.batches.split(",")):
        q = tuple(
            t.to(dev)
            for t in (
                torch.randn(b, e, d, generator=gen),
                torch.randn(b, e, d, generator=gen),
                torch.randn(b, e, generator=gen),
            )
        )
        t_ref = timed(lambda q=q: score_topk(q, table, mask, args.k), args.repeat)
        u = q[1][:, 0, :].to(torch.bfloat16)

        def two_tower(u=u):
            s = (u @ table[1].T).float().masked_fill(~mask, float("-inf"))  # [B, N]
            return s.topk(args.k, dim=1)

        t_tt = timed(two_tower, args.repeat)
        for what, t in (
            (f"moe score_topk reference (E={e})", t_ref),
            ("two-tower matmul + topk (E=1)", t_tt),
        ):
            print(f"{what:<34} {b:>4} {t:>9.3f} {n / t:>10.3g} {b * n / t:>10.3g}")


if __name__ == "__main__":
    main()
