"""The cut of a worker's share of each global batch into micro-batches: counted in samples, or in padded tokens.

In samples (TRM, the byte transformer, a language model's windows: every sample of a batch costs alike), the cut is
even and the same every step: micro-batches of at most `micro` samples (raytrm.train.memory.fit.cut). In padded
tokens (a Hugging Face classifier: its records come sorted longest first, and each micro-batch runs padded to its own
longest record), a micro-batch holds at most `micro` tokens counted as its records x its longest record, so that short
records pack more to a micro-batch than long ones while what a micro-batch holds in memory (its activations grow with
its padded tokens) keeps one bound. That cut is made anew for each step from its records' lengths: each micro-batch
takes the next records while its padded tokens stay within the bound, and holds at least one record.

Either way the micro-batches are contiguous slices of the share, in order, and each sample is in exactly one, so the
gradient is the share's whatever the cut (every micro-batch's loss is divided by the global batch's count).

On a CPU's threads side by side (raytrm.train.side_by_side), a cut in samples is dealt out as the threads' shares
(`side_by_side.plan`); a cut in padded tokens runs one micro-batch at a time, each split between the threads where its
padded tokens are most even (`side_by_side.balanced_shares`): each thread's part is padded to its own longest record,
so the parts in flight together never hold more padded tokens than the micro-batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from raytrm.train import side_by_side
from raytrm.train.memory.fit import cut

SAMPLES, TOKENS = "samples", "tokens"


def padded_tokens(lengths: Sequence[int], part: slice) -> int:
    """A micro-batch's padded tokens: its records, each padded to the longest of them."""
    return int(side_by_side.padded_cost(lengths, part))


def token_parts(lengths: Sequence[int], budget: int) -> list[slice]:
    """The records cut in order into micro-batches of at most `budget` padded tokens each (a record longer than the
    budget alone in its own)."""
    parts, start = [], 0
    while start < len(lengths):
        stop, longest = start + 1, int(lengths[start])
        while stop < len(lengths) and (stop + 1 - start) * max(longest, int(lengths[stop])) <= budget:
            longest = max(longest, int(lengths[stop]))
            stop += 1
        parts.append(slice(start, stop))
        start = stop
    return parts


class MicroBatches:
    """How this worker's share is cut into micro-batches (see the module), starting at `micro` samples at their
    widest a micro-batch (the config's micro-batch).

    width: the most tokens a sample may hold where the cut counts padded tokens (a classifier's max length); None
    where it counts samples.
    """

    def __init__(self, local_batch: int, micro: int, width: int | None = None) -> None:
        self.width = width
        self.unit = TOKENS if width else SAMPLES
        self.local_batch, self.micro = local_batch, micro
        #: The samples of each micro-batch: the cut in samples, or the latest step's cut in tokens.
        self.counts: list[int] = []
        #: The most units (samples, padded tokens) in flight at once in the latest step: what its peak grew with.
        self.in_flight = 0
        self.set(self.units(micro))

    def units(self, samples: int) -> int:
        """A number of samples at their widest, in this cut's unit."""
        return samples * (self.width or 1)

    def set(self, micro: int, local_batch: int | None = None) -> list[int]:
        """Cut at most `micro` units a micro-batch from now on (and this worker's share anew, where given); returns
        the samples of each micro-batch (in tokens: where every record is at its widest)."""
        if micro < 1:
            raise ValueError(f"a micro-batch of {micro} {self.unit}: expected at least 1")
        self.micro, self.local_batch = micro, local_batch or self.local_batch
        if self.width is None:
            self.counts = cut(self.local_batch, micro)
            self.in_flight = max(self.counts)
        else:  # until a step's records cut it: as if every record were at its widest
            self.parts([self.width] * self.local_batch)
        return self.counts

    @property
    def largest(self) -> int:
        """The cut, in its unit: the largest micro-batch in samples, or the padded tokens a micro-batch may hold."""
        return max(self.counts) if self.width is None else self.micro

    def samples_at_widest(self) -> int:
        """The samples a micro-batch holds where every one is at its widest (an evaluation's batch)."""
        return max(1, min(self.local_batch, self.largest // (self.width or 1)))

    def parts(self, lengths: Sequence[int] | None = None) -> list[slice]:
        """This step's micro-batches, slices of the share in order; a cut in tokens needs the records' lengths."""
        if self.width is None:
            bounds = [0, *itertools.accumulate(self.counts)]
            return [slice(a, b) for a, b in itertools.pairwise(bounds)]
        if lengths is None:
            raise ValueError("a cut in padded tokens needs the records' lengths")
        parts = token_parts(lengths, self.micro)
        self.counts = [p.stop - p.start for p in parts]
        self.in_flight = max(padded_tokens(lengths, p) for p in parts)
        return parts

    def plan(self, lengths: Sequence[int] | None, threads: int) -> tuple[list[slice], list[list[list[slice]]]]:
        """This step's micro-batches, and their rounds on `threads` threads side by side (`rounds`); no rounds where
        none would run two micro-batches at once: the micro-batches then run one after another."""
        parts = self.parts(lengths)
        rounds = self.rounds(parts, lengths, threads) if threads > 1 else []
        if not any(len(groups) > 1 for groups in rounds):
            return parts, []
        if self.width is not None:  # a round's parts are in flight together, each padded to its own longest
            assert lengths is not None
            self.in_flight = max(sum(padded_tokens(lengths, p) for [p] in groups) for groups in rounds)
        return parts, rounds

    def rounds(self, parts: list[slice], lengths: Sequence[int] | None, threads: int) -> list[list[list[slice]]]:
        """The step's micro-batches on `threads` threads side by side: rounds, run one after another, each a list of
        the threads' micro-batches (one list per thread). In samples: one round, the threads' shares
        (side_by_side.plan). In tokens: a round per micro-batch, split between the threads where its padded tokens
        are most even."""
        if self.width is None:
            return [side_by_side.plan(self.local_batch, self.largest, threads, lengths)]
        assert lengths is not None
        rounds = []
        for part in parts:
            shares = side_by_side.balanced_shares(list(lengths[part]), min(threads, part.stop - part.start))
            rounds.append([[slice(part.start + s.start, part.start + s.stop)] for s in shares])
        return rounds
