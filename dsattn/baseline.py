"""What a loss is measured against: the corpus's unigram baseline, and bits per byte.

The unigram baseline is the cross-entropy of the validation split's own token frequencies
(data.unigram_entropy): what a model that ignores context scores at best, so a loss is
worth only its distance below it. Bits per byte divide a loss's bits per token by the bytes
of text a token stands for: 1 on byte-level sources; a token directory's meta.json records
its splits' text bytes (scripts/prepare_data.py); token files record none.
"""

from __future__ import annotations

import math

from dsattn import data, tokendir
from dsattn.datasource import DataSource, SourceKind


def bytes_per_token(source: DataSource) -> float | None:
    """Bytes of text per token of `source`'s validation split (None where unrecorded)."""
    if source.byte_level:
        return 1.0
    if source.kind is not SourceKind.TOKEN_DIR:
        return None
    meta = tokendir.read_meta(source.paths[0])
    text = (meta.get("text_bytes") or {}).get("val")
    tokens = sum(shard["tokens"] for shard in meta["splits"]["val"])
    return text / tokens if text and tokens else None


def bits_per_byte(nats: float, per_token: float | None) -> float | None:
    return None if per_token is None else nats / math.log(2) / per_token


def unigram_nats(corpus) -> float:
    """The unigram baseline of a loaded corpus (data.Corpus), nats per token."""
    return data.unigram_entropy(corpus.val, corpus.vocab_size)


def compared(nats: float, corpus, source: DataSource) -> str:
    """'2.1000 nats/token (1.0000 bits/byte), 0.4000 below the unigram baseline 2.5000'."""
    bpb = bits_per_byte(nats, bytes_per_token(source))
    uni = unigram_nats(corpus)
    where = "below" if nats <= uni else "above"
    return (f"{nats:.4f} nats/token"
            + (f" ({bpb:.4f} bits/byte)" if bpb is not None else "")
            + f", {abs(uni - nats):.4f} {where} the unigram baseline {uni:.4f}")
