"""`score_topk`: the public dispatcher of the exhaustive score·filter·top-K pass (DESIGN §5).

Shapes: B requests, N ads, E experts, G gate-key dim, D value dim, K results.

Implementations of one contract (exact top-K, ties to the lower row):
* `torch`  — the chunked plain-PyTorch reference (`m31.ops.reference`: `torch_score_topk`), the
  definition of correct;
* `cpu`    — blocked bf16 (8-bit tables: int8) products, proven bounds, a threshold top-K
  (`m31.ops.cpu`: `cpu_score_topk`, `cpu_score_topk_int8`);
* `triton` — the fused GPU kernel (`m31.ops.triton`: `triton_score_topk`,
  `triton_score_topk_int8`); on CPU only under `TRITON_INTERPRET=1`.
`kernel="auto"` takes triton for CUDA tensors and cpu otherwise. An 8-bit table
(`m31.ops.quant.Int8Table`) is scored as its dequantized table; the `cpu` and `triton` kernels
read it as stored (8-bit products), the reference dequantizes it.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from m31.ops.contract import NO_ROW, NonFiniteQueryError, check_args
from m31.ops.masks import PackedMask
from m31.ops.quant import Int8Table
from m31.ops.reference.score_topk import torch_score_topk

KERNELS = ("torch", "cpu", "triton")


def available_kernels(device: torch.device | str = "cpu") -> tuple[str, ...]:
    """The implementations that can run on `device` in this process."""
    device = torch.device(device)
    names = ["torch"]
    if device.type == "cpu":
        names.append("cpu")
    triton_ok = importlib.util.find_spec("triton") is not None
    if triton_ok and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        names.append("triton")
    return tuple(names)


def _pick(kernel: str, device: torch.device) -> str:
    if kernel not in ("auto", *KERNELS):
        raise ValueError(f"unknown kernel {kernel!r}; choose auto or one of {', '.join(KERNELS)}")
    available = available_kernels(device)
    if kernel == "auto":
        return (
            "triton"
            if device.type == "cuda" and "triton" in available
            else ("cpu" if device.type == "cpu" else "torch")
        )
    if kernel not in available:
        raise ValueError(
            f"kernel {kernel!r} cannot run on {device} here (available: {', '.join(available)})"
        )
    return kernel


def score_topk(
    query: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ad_table: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | Int8Table,
    mask: torch.Tensor | PackedMask | None,
    k: int,
    kernel: str = "auto",
    value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K eligible ads of each request under the DESIGN §2 score, exact, ties to the lower row.

    query = (q [B, E, G], v [B, E, D], p [B, E]); ad_table = (g [N, G], x [N, D], b [N]) or an
    `Int8Table`; mask: bool [N] or [B, N], a `PackedMask` (bitmaps, one per distinct mask, as the
    index makes them: the `cpu` kernel unpacks a block's bytes at a time, the Triton kernel reads
    them as its int32 words), or None. Returns (scores [B, min(k, N)] fp32,
    rows [B, min(k, N)] int64), best first; a request with fewer eligible ads than that ends in
    rows NO_ROW (-1). `kernel`: auto, or one of KERNELS (see the module docstring). `value`:
    None, or fp32 [N], one more per-ad column that every kernel adds to the bias as it streams
    the table (`m31.ops.reference.score.value_bias`: the score is then s + value up to one fp32
    rounding of b + value; DESIGN §2, "The value term").

    Every kernel scores the fp32 query against the table's values as stored (products summed in
    fp32 or better; `rounded_score` is the reference's), so their answers agree up to fp32
    near-ties: ads whose scores lie a few ulps apart may come in either order. Byte-identical
    ads get identical scores on every kernel, so they tie in row order.

    Non-finite values. A query holding NaN or ±inf raises `NonFiniteQueryError` (a ValueError
    naming the tensor) on every kernel. With a finite query, a score beyond the fp32 range is
    ±inf, and on every kernel:
    * +inf ranks above every finite score; tied +inf scores come in row order;
    * an ad scoring -inf, or NaN (which takes NaN or ±inf in the ad table or its value), is
      never returned, as if ineligible: a request left with fewer ads ends in (NO_ROW, -inf)
      slots.
    The reference and the `cpu` kernel evaluate a score in fp64 and round it once, so only the
    score itself overflows (the `cpu` kernel hands inputs whose logits or scores could pass 2¹⁰⁰
    to the reference); the Triton kernel evaluates in fp32, where a gate logit or an affinity
    beyond 3.4e38 already overflows, and such an ad may score ±inf or NaN there alone.
    """
    q, v, p = query
    quantized = isinstance(ad_table, Int8Table)
    if quantized:
        ad_table.check()  # every kernel, the reference included, reads the same kind of table
    g, x, b = (ad_table.g, ad_table.x, ad_table.b) if quantized else ad_table
    check_args(q, v, p, g, x, b, mask, k, value)
    name = _pick(kernel, g.device)
    if name == "triton":
        from m31.ops.triton import triton_score_topk, triton_score_topk_int8

        if quantized:
            return triton_score_topk_int8(q, v, p, ad_table, mask, k, value=value)
        return triton_score_topk(q, v, p, g, x, b, mask, k, value=value)
    if name == "cpu":
        from m31.ops.cpu import cpu_score_topk, cpu_score_topk_int8

        if quantized:
            return cpu_score_topk_int8(q, v, p, ad_table, mask, k, value=value)
        return cpu_score_topk(q, v, p, g, x, b, mask, k, value=value)
    if quantized:  # the 8-bit table's score is the score of its dequantized table
        g, x, b = ad_table.dequantize()
    return torch_score_topk(q, v, p, g, x, b, mask, k, value=value)


__all__ = ["KERNELS", "NO_ROW", "NonFiniteQueryError", "available_kernels", "score_topk"]
