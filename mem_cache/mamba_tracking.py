"""Where Mamba checkpoints may be taken (seed 000 §5.3, reference §4.2).

A recurrent state can only be saved at a chunk boundary of the prefill kernel
(``FLA_CHUNK_SIZE`` = 64 tokens) and, while decoding, every
``mamba_track_interval`` tokens. These pure functions decide the positions;
the scheduler calls them and the model runner saves the state there.
"""

from __future__ import annotations

from typing import Optional

FLA_CHUNK_SIZE = 64
DEFAULT_MAMBA_TRACK_INTERVAL = 256


def mamba_branching_seqlen(full_match_len: int, mamba_match_len: int, chunk: int = FLA_CHUNK_SIZE) -> Optional[int]:
    """When the full-KV match runs deeper than the deepest Mamba checkpoint,
    the full-KV match length rounded down to a chunk: a checkpoint there lets
    the next request that shares this prefix branch off without recomputing."""
    if full_match_len <= mamba_match_len:
        return None
    aligned = full_match_len // chunk * chunk
    return aligned if aligned > 0 else None


def prefill_track_seqlen(
    prefix_len: int, extend_len: int, branching_len: Optional[int], chunk: int = FLA_CHUNK_SIZE
) -> Optional[int]:
    """The one position a prefill forward over ``[prefix_len, prefix_len +
    extend_len)`` saves a Mamba state at, or ``None``.

    The branching length when ``prefix < branching < prefix + extend`` and
    ``branching - prefix`` is a multiple of the chunk; otherwise the last
    chunk boundary of the extend, ``prefix + extend // chunk * chunk``;
    nothing when fewer than a chunk of tokens are computed.
    """
    end = prefix_len + extend_len
    if branching_len is not None and prefix_len < branching_len < end and (branching_len - prefix_len) % chunk == 0:
        return branching_len
    if extend_len < chunk:
        return None
    return prefix_len + extend_len // chunk * chunk


def decode_should_track(seq_len: int, mamba_track_interval: int = DEFAULT_MAMBA_TRACK_INTERVAL) -> bool:
    """Whether the decode step that brings a request to ``seq_len`` computed
    tokens saves a checkpoint (at absolute multiples of the interval)."""
    return seq_len % mamba_track_interval == 0


def max_prefix_match_len(input_len: int) -> int:
    """At most ``input_len - 1`` tokens are matched: one must always be computed
    to produce the next token's logits."""
    return max(input_len - 1, 0)
