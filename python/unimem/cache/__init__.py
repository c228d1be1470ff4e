"""Prefix caching above the memory pool: a page-granular radix tree of shared pages, SWA
windows and state checkpoints (see ``docs/prefix_cache.md``)."""

from unimem.cache.prefix_cache import Admission, CacheStats, Insertion, MatchResult, PrefixCache

__all__ = ["Admission", "CacheStats", "Insertion", "MatchResult", "PrefixCache"]
