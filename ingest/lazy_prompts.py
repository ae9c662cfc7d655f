"""A corpus tokenized a slice at a time: the ingest's prompts without holding every prompt's tokens.

:class:`LazyPrompts` is a ``Sequence[TokenizedPrompt]`` over the records of a data set.  Iterating it
tokenizes :data:`CHUNK` records at a time and keeps none (the ingest's validation and corpus hash pass,
before anything is written: a record that cannot be aligned is still refused before the store is
touched); a slice (one segment) is tokenized when asked for, and the last one is kept.  Memory: the
records (text and a few strings per prompt) plus one segment's tokens, instead of every prompt's
token ids, offsets and the batched tokenizer call's output over the whole corpus (about 18 KB a
prompt at 10^5 prompts, measured in benchmarks/bench_scale.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from actstore.ingest.align import tokenize_records
from actstore.ingest.datasets.common import SliceReader
from actstore.ingest.records import PromptRecord, TokenizedPrompt

CHUNK = 4096  # records per tokenizer call of a pass over the corpus


class LazyPrompts(SliceReader[TokenizedPrompt]):
    """``records`` tokenized on demand with ``tokenizer`` (see the module notes)."""

    chunk = CHUNK

    def __init__(
        self, records: Sequence[PromptRecord], tokenizer: Any, max_length: int | None = None
    ) -> None:
        self.records = records
        self.tokenizer = tokenizer
        self.max_length = max_length
        self._cached: tuple[int, int, list[TokenizedPrompt]] | None = None

    def __len__(self) -> int:
        return len(self.records)

    def _tokenize(self, lo: int, hi: int) -> list[TokenizedPrompt]:
        try:
            return tokenize_records(self.records[lo:hi], self.tokenizer, max_length=self.max_length)
        except Exception as e:  # name the record by its corpus index, not its index in the slice
            if lo and str(e).startswith("record "):
                head, _, rest = str(e).partition(" ")[2].partition(" ")
                if head.isdigit():
                    raise type(e)(f"record {lo + int(head)} {rest}") from None
            raise

    def _read(self, lo: int, hi: int) -> list[TokenizedPrompt]:
        return self._tokenize(lo, hi)

    def _read_slice(self, lo: int, hi: int) -> list[TokenizedPrompt]:  # the last slice is kept
        if self._cached is None or self._cached[:2] != (lo, hi):
            self._cached = (lo, hi, self._tokenize(lo, hi) if hi > lo else [])
        return self._cached[2]
