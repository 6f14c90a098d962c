"""Training examples for any method from plain sentences: the columns its collator reads (sentences;
with their negations, SNCSE; labelled pairs of neighbouring sentences, SBERT)."""

from __future__ import annotations

from typing import Any

from lightning_sentemb.data.negation import lexicon_tokens, negate
from lightning_sentemb.methods.base import SentEmbMethod


def training_examples(method: SentEmbMethod, sentences: list[str]) -> list[dict[str, Any]]:
    ids = method.encoder.format.sentence_ids(sentences)
    columns = method.collator.required_columns
    if "premise" in columns:
        return [{"premise": a, "hypothesis": b, "label": i % 3}
                for i, (a, b) in enumerate(zip(ids, ids[1:] + ids[:1], strict=True))]
    if "negation" in columns:
        negations = method.encoder.format.sentence_ids([negate(lexicon_tokens(s)).text for s in sentences])
        return [{"sent0": a, "negation": b} for a, b in zip(ids, negations, strict=True)]
    return [{"sent0": row} for row in ids]
