"""When a candidate is too close to an anchor to be its negative: the one rule that hard-negative mining
(`sentemb data mine`) and the guide's false-negative filter (`model.init_args.guide`) share.

The threshold is the anchor's positive score less a margin (GISTEmbed's and sentence-transformers'
`absolute` and `relative` margins), or a fixed score (DCLR's φ); a candidate scoring above it is too
close. Whether a candidate scoring exactly the threshold is too close is the tie rule, an argument:
sentence-transformers' mining and `GISTEmbedLoss` and Qwen3-Embedding keep it (strictly above is too
close); DCLR's paper drops it (its weight is 0 at or above φ).

Plain comparisons, so numpy arrays (mining) and torch tensors (the guide, on the device) alike.
"""

from __future__ import annotations

from typing import Literal, TypeVar

MarginStrategy = Literal["absolute", "relative"]
Ties = Literal["kept", "dropped"]
MARGIN_STRATEGIES: tuple[str, ...] = MarginStrategy.__args__
TIES: tuple[str, ...] = Ties.__args__

Scores = TypeVar("Scores")  # a numpy array or a torch tensor


def margin_threshold(positive: Scores, margin: float, strategy: MarginStrategy) -> Scores:
    """The highest score a negative may have: the positive's score less `margin` (absolute), or less
    `margin` × |positive's score| (relative: sentence-transformers' convention, which keeps the threshold
    below the positive for a negative positive score)."""
    if strategy == "absolute":
        return positive - margin
    if strategy == "relative":
        return positive - abs(positive) * margin
    raise ValueError(f"margin strategy must be one of {', '.join(MARGIN_STRATEGIES)}; got {strategy!r}")


def too_close(scores: Scores, threshold: Scores | float, ties: Ties) -> Scores:
    """Where a candidate's score passes `threshold`: above it, or with `ties` "dropped" at or above it."""
    if ties == "kept":
        return scores > threshold
    if ties == "dropped":
        return scores >= threshold
    raise ValueError(f"ties must be one of {', '.join(TIES)}; got {ties!r}")
