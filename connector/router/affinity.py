"""Prefix-cache affinity: which backend most likely holds a request's prompt prefix. Pure.

Owns: ``prefix_text`` (the part of a client body an engine's prefix cache keys on),
``block_hashes`` (chained hashes of fixed-size character blocks of it: request B shares
the first k hashes of request A exactly when their first k blocks are equal), ``PrefixTable``
(which backend each recently routed block chain went to, least recently used forgotten
first) and ``rendezvous`` (a choice among backends by the first block alone, the same in
every router replica, for a prefix no table entry names).

The table approximates the engines' caches (llm-d's prefix scorer does the same): an
engine may have evicted what the table says it holds; that costs a recompute, never a
wrong answer.

Must not import: httpx, aiohttp, starlette, asyncio, or anything else of the router.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

# Hashing stops after this many blocks (8192 characters at 64 a block): prompts equal for
# that long are routed together, and a long prompt costs the router no more than that
# (docs/routers.md, "Choosing P and D", has the cost).
MAX_BLOCKS = 128
TABLE_ENTRIES = 1 << 16  # per role: block chains remembered (about 8 MiB)


def prefix_text(body: Mapping[str, Any]) -> str | None:
    """What an engine's prefix cache keys on, as one string: the cache salt, then the
    prompt (completions) or the messages in order (chat). None when the body has neither."""
    salt = body.get("cache_salt")
    head = f"{salt}\x00" if isinstance(salt, str) else ""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return head + prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return head + ",".join(map(str, prompt))
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        # In order, one JSON object per message: equal leading messages give equal text.
        return head + "".join(json.dumps(m, sort_keys=True, ensure_ascii=False) for m in messages)
    return None


def block_hashes(text: str, block_chars: int) -> tuple[int, ...]:
    """Chained 64-bit hashes of ``text``'s full ``block_chars`` blocks (a partial last block
    is left out: engines cache whole blocks only), at most ``MAX_BLOCKS``."""
    if block_chars < 1:
        raise ValueError(f"block_chars must be >= 1, got {block_chars}")
    out: list[int] = []
    prev = b""
    for i in range(min(len(text) // block_chars, MAX_BLOCKS)):
        block = text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        prev = hashlib.blake2b(prev + block, digest_size=8).digest()
        out.append(int.from_bytes(prev, "big"))
    return tuple(out)


class PrefixTable:
    """Which backend (by index) each block chain was last routed to. ``holders`` walks a
    request's chain from its longest prefix down, so the backend holding most of it comes
    first."""

    def __init__(self, capacity: int = TABLE_ENTRIES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def holders(self, hashes: Sequence[int]) -> list[tuple[int, int]]:
        """(backend index, blocks it holds of ``hashes``) for each backend the table names,
        longest match first; each backend once."""
        out: list[tuple[int, int]] = []
        seen: set[int] = set()
        for n in range(len(hashes), 0, -1):
            index = self._entries.get(hashes[n - 1])
            if index is not None and index not in seen:
                seen.add(index)
                out.append((index, n))
        return out

    def record(self, hashes: Sequence[int], index: int) -> None:
        """``index`` now holds every block of ``hashes`` (it computed or received them)."""
        entries = self._entries
        for h in hashes:
            entries[h] = index
            entries.move_to_end(h)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def forget(self, index: int) -> None:
        """Drop every entry of ``index`` (a backend removed, or restarted with a cold cache)."""
        for h in [h for h, i in self._entries.items() if i == index]:
            del self._entries[h]


def rendezvous(first_block: int, keys: Sequence[str]) -> int:
    """Highest-random-weight choice among backends named by ``keys`` (their URLs) for a
    prefix: the position of the winner. The same in every router replica whatever order
    it lists its backends in, and removing a backend moves only the prefixes it had."""
    if not keys:
        raise ValueError("rendezvous over no backends")

    def weight(pos: int) -> bytes:
        return hashlib.blake2b(f"{first_block}:{keys[pos]}".encode(), digest_size=8).digest()

    return max(range(len(keys)), key=weight)
