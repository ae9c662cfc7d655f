"""The store's weights as float32 torch tensors, loaded once per store and kept while it lives: what
the feature kinds (:mod:`~actstore.query.select.features`) and the per-source reads
(:mod:`~actstore.query.select.corpus_sources`) multiply the stored factors by.

They are read from the copy the store uses (:attr:`StoreReader.weights_source`: its own ``weights/``,
else the shared copy of this machine's cache with the hash its ``weights.json`` records; see
:mod:`actstore.core.weight_store`); a store with neither (``--weights none``, or a shared copy not on
this machine) refuses at the first weight read with one line saying what to do
(:class:`~actstore.core.errors.WeightsUnavailableError`)."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from actstore.core.errors import QueryError

if TYPE_CHECKING:
    from actstore.core.store import StoreReader


class WeightCache:
    """Weights as float32 torch tensors, loaded once per store (weights never change once written)."""

    def __init__(self, store: StoreReader) -> None:
        self._store = weakref.ref(store)  # the cache must not keep its store alive (see _CACHES)
        self._w: dict[str, torch.Tensor] = {}
        self._by_layer: dict[tuple[str, int], torch.Tensor] = {}
        self._picked: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._chunked: dict[str, bool] = {}

    def _of(self) -> StoreReader:
        store = self._store()
        if store is None:
            raise QueryError("the store of this weight cache was closed")
        return store

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._w:
            self._w[name] = torch.from_numpy(self._of().weight(name))
        return self._w[name]

    def layers(self, name: str, layers: list[int]) -> torch.Tensor:
        """Weight ``name`` (layers first: ``W_O``, ``b_O``, ``W_down``, ``b_down``) at ``layers`` only.
        Unless the whole weight is loaded already, each layer is read alone and kept (a store chunks
        these weights one layer per chunk), so a read of three layers of a freshly opened store reads
        three layers' weights, not all of them (SmolLM2's ``W_O``: 40 MB)."""
        store = self._of()
        if name not in self._chunked:  # (asked once: opening the array is a read of its metadata)
            self._chunked[name] = store.layer_chunked(name)
        if name in self._w or len(layers) == store.geometry.n_layers or not self._chunked[name]:
            return pick(self[name], layers, 0)
        key = (name, tuple(layers))
        if key not in self._picked:  # (kept: every row block of a query asks again)
            for layer in layers:
                if (name, layer) not in self._by_layer:
                    self._by_layer[name, layer] = torch.from_numpy(store.weight(name, layer))
            self._picked[key] = torch.stack([self._by_layer[name, layer] for layer in layers])
        return self._picked[key]


_CACHES: weakref.WeakKeyDictionary[StoreReader, WeightCache] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def weights(store: StoreReader) -> WeightCache:
    """The weight cache of ``store``, made on first use and dropped with the store."""
    with _CACHES_LOCK:
        cache = _CACHES.get(store)
        if cache is None:
            cache = _CACHES[store] = WeightCache(store)
        return cache


def pick(x: Any, idx: list[int], dim: int) -> Any:
    """``x`` restricted to positions ``idx`` along ``dim`` (numpy or torch).

    A contiguous ascending ``idx`` (all layers, a layer range) is a slice, i.e. a view; fancy
    indexing would copy, e.g. all of ``W_down`` (106 MB for SmolLM2) for every row block.
    """
    pre = (slice(None),) * dim
    if idx and idx == list(range(idx[0], idx[0] + len(idx))):
        return x[(*pre, slice(idx[0], idx[0] + len(idx)))]
    return x[(*pre, idx)]
