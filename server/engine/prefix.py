"""Prefix caching's names for KV blocks: a hash chained over a sequence's token ids.

Block ``i`` of a sequence holds positions ``[i * size, (i + 1) * size)``. Its hash covers the
model (``salt``: the export's manifest hash), the block size and every token id from position 0
to the block's end, chained block by block (``h_i = H(h_{i-1}, tokens of block i)``), so two
sequences share a block's hash exactly when they share everything up to its end: the KV the
block holds is then the same. Paged stages keep hashed blocks for later sessions
(``pb.Step.block_hashes``, ``pb.AcquireRequest``); the gateway and its draft name them here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_BYTES = 16


class HashChain:
    """The block hashes of one growing sequence, computed once each."""

    def __init__(self, salt: str, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("a block holds at least one position")
        self.block_size = block_size
        self._root = hashlib.blake2b(
            f"pipeshard-prefix-v1:{salt}:{block_size}".encode(), digest_size=DIGEST_BYTES
        ).digest()
        self.hashes: list[bytes] = []

    def extend(self, tokens: Sequence[int], blocks: int) -> list[bytes]:
        """The hashes of the first ``blocks`` blocks of ``tokens`` (each block full)."""
        size = self.block_size
        if blocks * size > len(tokens):
            filled = len(tokens) // size
            raise ValueError(f"{len(tokens)} tokens fill {filled} blocks, not {blocks}")
        while len(self.hashes) < blocks:
            i = len(self.hashes)
            previous = self.hashes[-1] if self.hashes else self._root
            ids = np.asarray(tokens[i * size : (i + 1) * size], dtype="<i8").tobytes()
            self.hashes.append(hashlib.blake2b(previous + ids, digest_size=DIGEST_BYTES).digest())
        return self.hashes[:blocks]

    def filled(self, tokens: Sequence[int], start: int, end: int) -> list[bytes]:
        """The hashes a step that feeds positions ``[start, end)`` of ``tokens`` publishes:
        those of the blocks from ``start // size`` that it fills (``pb.Step.block_hashes``)."""
        size = self.block_size
        first, last = start // size, end // size
        return self.extend(tokens, last)[first:last] if last > first else []

    def reusable(self, tokens: Sequence[int]) -> list[bytes]:
        """The hashes of the blocks a new session of ``tokens`` may take from a cache: whole
        blocks, leaving at least two tokens to compute (the last one's logits are sampled, and
        a one-token chunk would take another kernel path than the rest of a prompt)."""
        return self.extend(tokens, max(0, len(tokens) - 2) // self.block_size)


class PrefixLookup:
    """Each sequence's block hashes: what its session may open on (its lookup) and which
    blocks its steps fill. Only prompt chunks name blocks (a prompt's, or a resumed
    sequence's prompt and generated tokens): decode-time K/V is close to a prefill's, not
    equal, and a later prompt that took it could get other tokens than one that prefills it
    (measured on the default model: a chat's next turn did)."""

    def __init__(self, salt: str, block_size: int) -> None:
        self.salt = salt
        self.block_size = block_size
        self._chains: dict[str, HashChain] = {}

    def _chain(self, seq_id: str) -> HashChain:
        chain = self._chains.get(seq_id)
        if chain is None:
            chain = self._chains[seq_id] = HashChain(self.salt, self.block_size)
        return chain

    def reusable(self, seq_id: str, prefix: Sequence[int]) -> list[bytes]:
        """The hashes of the cached blocks a new session of ``prefix`` may open on."""
        return self._chain(seq_id).reusable(prefix)

    def filled(
        self, seq_id: str, prefix: Sequence[int], start: int, end: int, prefill: bool
    ) -> list[bytes]:
        """The hashes of the blocks a step feeding ``[start, end)`` of ``prefix`` fills and
        the stages keep (none for a decode step)."""
        return self._chain(seq_id).filled(prefix, start, end) if prefill else []

    def forget(self, seq_id: str) -> None:
        self._chains.pop(seq_id, None)
