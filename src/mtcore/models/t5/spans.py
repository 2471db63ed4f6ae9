"""How long a piece of a document span corruption takes, and what its corrupted input and
target need (``span_lengths``): arithmetic the config checks without the data pipeline
(torch, numpy). The corruption itself is ``data``'s."""

from __future__ import annotations

from typing import NamedTuple

from mtcore.data.cache import DataError
from mtcore.models.t5.names import NUM_SENTINELS


def span_counts(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a piece of ``length >= 2`` tokens: at least one
    of each, and at least one kept token per span (a kept run precedes each span)."""
    noise = min(max(round(length * noise_density), 1), length - 1)
    spans = min(max(round(noise / mean_span_length), 1), noise, length - noise)
    return noise, spans


class SpanLengths(NamedTuple):
    """The piece length and what its corruption needs: ``encoder_len`` (kept tokens, a
    sentinel per span, ``</s>``) and ``decoder_len`` (a sentinel per span, the noise,
    ``</s>``)."""

    raw_len: int
    noise: int
    spans: int
    encoder_len: int
    decoder_len: int


def lengths_of(raw_len: int, noise_density: float, mean_span_length: float) -> SpanLengths:
    noise, spans = span_counts(raw_len, noise_density, mean_span_length)
    return SpanLengths(raw_len, noise, spans, raw_len - noise + spans + 1, noise + spans + 1)


def span_lengths(
    encoder_len: int,
    noise_density: float = 0.15,
    mean_span_length: float = 3.0,
    decoder_len: int | None = None,
) -> SpanLengths:
    """The longest piece whose corrupted input fits ``encoder_len`` (and whose target
    fits ``decoder_len``, when given), or a DataError naming the lengths.

    Both needs grow with the piece length, so the first piece that does not fit ends
    the search. T5's 512 input tokens at 0.15 / 3 are 568-token pieces, 114 targets.
    """
    best = None
    for raw in range(2, 2 * encoder_len + 8):
        need = lengths_of(raw, noise_density, mean_span_length)
        if need.encoder_len > encoder_len or (
            decoder_len is not None and need.decoder_len > decoder_len
        ):
            break
        best = need
    if best is None:
        smallest = lengths_of(2, noise_density, mean_span_length)
        lengths = f"encoder length {encoder_len}"
        if decoder_len is not None:
            lengths += f" and decoder length {decoder_len}"
        raise DataError(
            f"{lengths} cannot hold one corrupted span: span corruption needs at least "
            f"{smallest.encoder_len} encoder and {smallest.decoder_len} decoder positions"
        )
    if best.spans > NUM_SENTINELS:
        raise DataError(
            f"encoder length {encoder_len} gives pieces of {best.raw_len} tokens with "
            f"{best.spans} noise spans, more than the {NUM_SENTINELS} sentinel tokens"
        )
    return best
