"""What a store's segments and weights must look like: file names, the shapes a commit marker and the
geometry imply, and the commit markers read from a location."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zarr

from actstore.core.arrays import check_array
from actstore.core.errors import CorruptStoreError
from actstore.core.manifest import MAX_JSON_BYTES, Geometry, Manifest, SegmentCommit
from actstore.core.storage.base import StoreLocation

_HEX = frozenset("0123456789abcdef")
MARKER_READERS = 8  # commit markers read at once


def tokenizer_file_name_ok(name: str) -> bool:
    """True for a plain file name a tokenizer folder may hold (no path, no leading dot, 128 characters)."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 128
        and name.isascii()
        and name[0].isalnum()
        and all(c.isalnum() or c in "._-" for c in name)
    )


def unwritten_arrays(manifest: Manifest) -> frozenset[str]:
    """The segment arrays whose chunks a store does not write: the kinds a corpus store's ingest kept
    no layer of (``ingest.kept[kind] == []``: all zeros by that record, their ``zarr.json`` only; since
    2026-12-07, docs/format.md, Chunks). Readers read them as zeros; an older store that wrote their
    zero chunks reads as before."""
    kept = (manifest.ingest or {}).get("kept")
    if not isinstance(kept, dict):
        return frozenset()
    return frozenset(k for k in ("z", "mlp", "resid") if isinstance(kept.get(k), list) and not kept[k])


def segment_name(seg: int) -> str:
    return f"{seg:06d}"


def expected_shape(g: Geometry, name: str, commit: SegmentCommit) -> tuple[int, ...]:
    """The shape of segment array ``name`` that the geometry and ``commit``'s sizes imply."""
    return {
        "z": (commit.n_rows, g.n_layers, g.n_heads, g.d_head),
        "attn": (commit.n_sources, g.n_layers, g.n_heads),
        "v": (commit.n_tokens, g.n_layers, g.n_kv_heads, g.d_head),
        "resid": (commit.n_rows, g.n_layers + 1, g.d_model),
        "mlp": (commit.n_rows, g.n_layers, g.d_mlp),
    }[name]


def expected_weight_shape(g: Geometry, name: str) -> tuple[int, ...] | None:
    """The shape of a stored weight the ingest writes (None for a name it does not write)."""
    L, H, Hkv, dh, d = g.n_layers, g.n_heads, g.n_kv_heads, g.d_head, g.d_model
    return {
        "W_O": (L, H, dh, d),
        "b_O": (L, d),
        "W_V": (L, Hkv, d, dh),
        "b_V": (L, Hkv, dh),
        "W_down": (L, g.d_mlp, d),
        "b_down": (L, d),
        "unembed": (g.vocab_size, d),
        "unembed_bias": (g.vocab_size,),
        "final_norm_weight": (d,),
        "final_norm_bias": (d,),
    }.get(name)


def check_weight(g: Geometry, name: str, arr: zarr.Array, where: str) -> None:
    """Refuse a weight whose metadata the geometry cannot explain (a made-up shape is never allocated).
    ``embed`` may have other rows than the vocabulary; names the ingest does not write are bounded by the
    largest weight it does."""
    want = expected_weight_shape(g, name)
    if want is None:
        if (
            name == "embed"
            and arr.ndim == 2
            and int(arr.shape[1]) == g.d_model
            and arr.shape[0] <= 4 * g.vocab_size
        ):
            want = tuple(int(n) for n in arr.shape)
        else:
            limit = max(
                int(np.prod(s, dtype=np.float64))
                for s in (expected_weight_shape(g, n) or () for n in ("W_O", "W_V", "W_down", "unembed"))
            )
            if int(np.prod(arr.shape, dtype=np.float64)) > limit or arr.ndim > 4:
                raise CorruptStoreError(
                    f"{where}: shape {tuple(arr.shape)} is larger than any weight of this geometry"
                )
    check_array(arr, where, want, None, max_chunks=1 << 16)


def commit_name_ok(name: str) -> bool:
    """True for a commit marker's file name (``NNNNNN.json``, six or more digits)."""
    stem, dot, ext = name.partition(".")
    return ext == "json" and dot == "." and len(stem) >= 6 and stem.isascii() and stem.isdigit()


def read_commits(
    location: StoreLocation, manifest: Manifest, skip: set[int] | None = None
) -> dict[int, SegmentCommit]:
    """Every commit marker under ``commits/``, checked: its size, fields and checksum, and that its
    ``segment`` field matches its file name and the manifest's row layout; ``skip``: segments whose
    markers are not read (those a snapshot covers).  Readers and a resuming
    writer both use this one list, so they cannot disagree about what is committed."""
    names: list[str] = []
    for name in location.listdir("commits"):
        if not name.endswith(".json"):
            continue  # temporary files of atomic writes
        if skip and commit_name_ok(name) and int(name[:-5]) in skip:
            continue  # covered by the snapshot
        if not commit_name_ok(name):
            raise CorruptStoreError(f"{location.url}/commits/{name}: not a commit marker name (NNNNNN.json)")
        names.append(name)
    commits: dict[int, SegmentCommit] = {}
    # The files are read on threads (on an object store, GETs at once; locally, reads that wait on the
    # disk), and checked here in name order, so the first bad marker is the one a loop would report.
    with ThreadPoolExecutor(max_workers=MARKER_READERS) as pool:
        datas = pool.map(lambda n: location.read_bytes(f"commits/{n}", MAX_JSON_BYTES), names)
        for name, data in zip(names, datas, strict=True):
            where = f"{location.url}/commits/{name}"
            c = SegmentCommit.from_json(data, where)
            c.check_against(manifest, name, where)
            commits[c.segment] = c
    return dict(sorted(commits.items()))
