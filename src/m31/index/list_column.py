"""One str_list attribute field in CSR form (`ListColumn`): what `m31.index.attributes` keeps
of each list field, so that memory grows with the values rows hold, not with vocabulary x rows.

Shapes: cap allocated rows, M entries (a (row, code) pair each; Mcap allocated), k rows in one
call, m entries in one call.
"""

from __future__ import annotations

import torch

MAX_CACHED_MASKS = 64  # per list field: N bytes each


def ranges(start: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """[sum(count)] int64: the ranges start[i] .. start[i] + count[i] - 1, one after another."""
    total = int(count.sum())
    first = torch.cumsum(count, 0) - count  # [k] where range i begins in the output
    step = torch.arange(total, device=start.device)  # [total]
    return torch.repeat_interleave(start - first, count, output_size=total) + step


class ListColumn:
    """The sets of one str_list field in CSR form: the codes of each row are `count[row]`
    consecutive entries of flat arrays, from `start[row]`. Memory grows with the entries (8
    bytes each) and the rows (12 bytes each), whatever the size of the vocabulary.

    A row's new set may be longer than its old one, so rewriting a row appends its new entries
    and marks the old ones dead (code -1) rather than shifting every later row; once dead
    entries are half of all, the next append that needs room drops them instead of growing.
    """

    def __init__(self, cap: int, device: torch.device):
        self.codes = torch.zeros(0, dtype=torch.int32, device=device)  # [Mcap]
        self.owner = torch.zeros(0, dtype=torch.int32, device=device)  # [Mcap] row of each
        self.start = torch.zeros(cap, dtype=torch.int64, device=device)  # [cap]
        self.count = torch.zeros(cap, dtype=torch.int32, device=device)  # [cap]
        self.used = 0  # entries appended, live or dead: the next one goes here
        self.dead = 0
        # contains() scans every entry, but requests ask about the same few values (their
        # country, platform, surface): a row mask per value asked is kept until the next change.
        self._hits: dict[tuple[int, int], torch.Tensor] = {}

    def reserve_rows(self, cap: int, n: int) -> None:
        self._hits.clear()
        for name in ("start", "count"):
            old = getattr(self, name)
            grown = torch.zeros(cap, dtype=old.dtype, device=old.device)  # [cap]
            grown[:n] = old[:n]
            setattr(self, name, grown)

    def _make_room(self, m: int) -> None:
        """Room for m more entries after `used`."""
        if self.used + m <= len(self.codes):
            return
        if self.dead * 2 >= self.used:
            alive = self.codes[: self.used] >= 0  # [M]
            # Where each old entry lands, plus the end: rows keep their entries contiguous.
            moved = torch.zeros(self.used + 1, dtype=torch.int64, device=alive.device)  # [M+1]
            moved[1:] = torch.cumsum(alive, 0)
            self.start = moved[self.start]
            self.codes, self.owner = self.codes[: self.used][alive], self.owner[: self.used][alive]
            self.used, self.dead = len(self.codes), 0
        if self.used + m > len(self.codes):
            size = max(self.used + m, 2 * len(self.codes))  # geometric: amortised O(1) copies
            codes = torch.full((size,), -1, dtype=torch.int32, device=self.codes.device)  # [Mcap]
            owner = torch.zeros(size, dtype=torch.int32, device=self.codes.device)  # [Mcap]
            codes[: self.used], owner[: self.used] = (
                self.codes[: self.used],
                self.owner[: self.used],
            )
            self.codes, self.owner = codes, owner

    def write(self, rows: torch.Tensor, codes: torch.Tensor, where: torch.Tensor) -> None:
        """Set the sets of distinct rows [k]: entry j holds code codes[j] for row rows[where[j]];
        (where, codes) pairs are distinct and grouped by `where` in ascending order."""
        self._hits.clear()
        old = self.count[rows]  # [k]
        if bool((old > 0).any()):
            self.codes[ranges(self.start[rows], old)] = -1  # a rewritten row loses its words
            self.dead += int(old.sum())
        m = len(codes)
        self._make_room(m)
        count = torch.bincount(where, minlength=len(rows)).to(torch.int32)  # [k]
        self.codes[self.used : self.used + m] = codes.to(torch.int32)
        self.owner[self.used : self.used + m] = rows[where].to(torch.int32)
        self.start[rows] = self.used + torch.cumsum(count, 0) - count
        self.count[rows] = count
        self.used += m

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [m], counts [k]) of rows [k]: their entries, row after row."""
        count = self.count[rows]  # [k]
        return self.codes[ranges(self.start[rows], count)], count

    def contains(self, code: int, n: int) -> torch.Tensor:
        """[n] bool, the caller's own (a copy: N bytes, against a scan of every entry)."""
        mask = self._hits.get((code, n))
        if mask is None:
            mask = torch.zeros(n, dtype=torch.bool, device=self.codes.device)  # [N]
            mask[self.owner[: self.used][self.codes[: self.used] == code]] = True
            if len(self._hits) >= MAX_CACHED_MASKS:
                self._hits.pop(next(iter(self._hits)))  # the oldest
            self._hits[(code, n)] = mask
        return mask.clone()
