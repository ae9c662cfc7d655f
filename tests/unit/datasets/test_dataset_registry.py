"""Public data sets by name (ingest/datasets/registry.py), against a real HTTP server on 127.0.0.1.

The server serves the project's own fixtures (tests/data, the same layout as $ACTSTORE_DATA) as a
mirror; the registry is replaced by one whose pins are the fixtures' SHA-256, computed here with
hashlib.  Nothing is ever downloaded from the internet.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from helpers import FIXTURES, real_data

from actstore.core.errors import DatasetError
from actstore.ingest.datasets import registry
from actstore.ingest.datasets.codex import triple_files
from actstore.ingest.datasets.common import DatasetResult
from actstore.ingest.datasets.dispatch import load_dataset
from actstore.ingest.datasets.fewrel import load_fewrel
from actstore.ingest.datasets.known1000 import load_known1000
from actstore.ingest.datasets.lre import load_lre
from actstore.ingest.datasets.maps import load_maps
from actstore.ingest.datasets.pins import SHA256

# The files each named data set needs, as globs in the fixtures' (= $ACTSTORE_DATA's) layout.
FIXTURE_FILES = {
    "fewrel": ["fewrel/val_wiki.json", "fewrel/pid2name.json"],
    "lre": ["lre_relations/data/*/*.json"],
    "known1000": ["known_1000/known_1000.json"],
    "maps": ["maps/datasets/*/*.json"],
    "codex-m": ["codex_m/train.txt", "codex_m/valid.txt", "codex_m/test.txt"],
}
LOADERS: dict[str, Callable[..., DatasetResult]] = {
    "fewrel": load_fewrel,
    "lre": load_lre,
    "known1000": load_known1000,
    "maps": load_maps,
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fixture_files(name: str) -> dict[str, str]:
    files = {}
    for pattern in FIXTURE_FILES[name]:
        for p in sorted(FIXTURES.glob(pattern)):
            files[p.relative_to(FIXTURES).as_posix()] = sha256(p)
    assert files, name
    return files


class Mirror:
    """A ThreadingHTTPServer on 127.0.0.1 serving ``root``; counts GET requests per path and can
    serve altered bytes for chosen paths."""

    def __init__(self, root: Path) -> None:
        self.requests: list[str] = []
        self.altered: dict[str, bytes] = {}
        mirror = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server method name)
                mirror.requests.append(self.path)
                body = mirror.altered.get(self.path.lstrip("/"))
                if body is None:
                    super().do_GET()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self.thread.join()


@pytest.fixture
def mirror(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Mirror]:
    """The fixture mirror, the registry pinned to the fixtures, an empty cache, no $ACTSTORE_DATA."""
    m = Mirror(FIXTURES)
    fixture_registry = {
        name: dataclasses.replace(ds, files=fixture_files(name)) for name, ds in registry.DATASETS.items()
    }
    monkeypatch.setattr(registry, "DATASETS", fixture_registry)
    monkeypatch.delenv(registry.DATA_ENV, raising=False)
    monkeypatch.setenv(registry.MIRROR_ENV, m.url)
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    yield m
    m.close()


@pytest.mark.parametrize("name", sorted(FIXTURE_FILES))
def test_fetch_downloads_once_then_reads_the_cache(mirror: Mirror, tmp_path: Path, name: str) -> None:
    files = fixture_files(name)
    path = registry.fetch(name)
    cache = tmp_path / "cache"
    ds = registry.DATASETS[name]
    assert path == cache / ds.entry
    assert sorted(r.lstrip("/") for r in mirror.requests) == sorted(files)
    for rel in files:
        assert (cache / rel).read_bytes() == (FIXTURES / rel).read_bytes()
    if name in LOADERS:  # loading by name gives what the loader gives on the fixture itself
        assert load_dataset(name).records == LOADERS[name](FIXTURES / ds.entry).records
    else:
        assert [p.read_bytes() for p in triple_files(path)] == [
            (FIXTURES / f"codex_m/{s}.txt").read_bytes() for s in ("train", "valid", "test")
        ]
    n = len(mirror.requests)
    assert registry.fetch(name) == path
    assert len(mirror.requests) == n, "a cached data set made a request"


def test_load_dataset_by_name_takes_the_loader_options(mirror: Mirror) -> None:
    want = load_fewrel(
        FIXTURES / "fewrel" / "val_wiki.json",
        relations=["P177"],
        limit_per_relation=3,
        keep_object_first=True,
    )
    got = load_dataset("FewRel", relations=["P177"], limit_per_relation=3, keep_object_first=True)
    assert got.records == want.records and got.skipped == want.skipped
    assert got.records[0].relation_name != "P177"  # pid2name.json was fetched beside the file


def test_a_file_with_the_wrong_hash_is_refused_and_not_kept(mirror: Mirror, tmp_path: Path) -> None:
    rel = "fewrel/val_wiki.json"
    good = (FIXTURES / rel).read_bytes()
    mirror.altered[rel] = good.replace(b"P177", b"P178", 1)
    with pytest.raises(DatasetError) as info:
        registry.fetch("fewrel")
    message = str(info.value)
    assert "\n" not in message and f"{mirror.url}/{rel}" in message and "SHA-256" in message
    assert "not kept" in message
    folder = tmp_path / "cache" / "fewrel"
    assert not (folder / "val_wiki.json").exists()
    assert [p.name for p in folder.iterdir()] == ["pid2name.json"]  # no temporary file left behind
    # fixed upstream: the next fetch downloads it
    del mirror.altered[rel]
    assert registry.fetch("fewrel").read_bytes() == good


def test_a_damaged_cached_file_is_downloaded_again(mirror: Mirror) -> None:
    path = registry.fetch("known1000")
    good = path.read_bytes()
    path.write_bytes(good[:-10])
    n = len(mirror.requests)
    assert registry.fetch("known1000").read_bytes() == good
    assert mirror.requests[n:] == ["/known_1000/known_1000.json"]
    # and a damaged file is refused when the mirror serves the same damage
    path.write_bytes(good[:-10])
    mirror.altered["known_1000/known_1000.json"] = good[:-10]
    with pytest.raises(DatasetError, match="SHA-256"):
        registry.fetch("known1000")


def test_offline_is_one_line_naming_the_url_and_the_variable(mirror: Mirror) -> None:
    url = mirror.url
    mirror.close()  # nothing listens on the port any more
    with pytest.raises(DatasetError) as info:
        load_dataset("maps")
    message = str(info.value)
    assert "\n" not in message
    assert f"{url}/maps/datasets/" in message and "ACTSTORE_DATA" in message and "no connection" in message
    assert "maps/datasets" in message and "127.0.0.1" in message


def test_a_missing_file_on_the_mirror_names_the_status(
    mirror: Mirror, monkeypatch: pytest.MonkeyPatch
) -> None:
    fewrel = registry.DATASETS["fewrel"]
    files = {**fewrel.files, "fewrel/absent.json": "0" * 64}
    monkeypatch.setitem(registry.DATASETS, "fewrel", dataclasses.replace(fewrel, files=files))
    with pytest.raises(DatasetError, match=r"absent\.json failed \(HTTP 404\)"):
        registry.fetch("fewrel")


def test_actstore_data_is_read_without_a_request(
    mirror: Mirror, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(registry.DATA_ENV, str(FIXTURES))
    for name, ds in registry.DATASETS.items():
        assert registry.fetch(name) == FIXTURES / ds.entry
    assert load_dataset("lre").records == load_lre(FIXTURES / "lre_relations" / "data").records
    assert mirror.requests == []
    assert not (tmp_path / "cache").exists()
    # a data folder without this data set: the cache, then the mirror
    monkeypatch.setenv(registry.DATA_ENV, str(tmp_path / "empty"))
    assert registry.fetch("known1000") == tmp_path / "cache" / "known_1000" / "known_1000.json"
    assert mirror.requests == ["/known_1000/known_1000.json"]


def test_names_and_specs(mirror: Mirror) -> None:
    with pytest.raises(DatasetError, match="codex-m is a knowledge graph"):
        load_dataset("codex-m")
    with pytest.raises(DatasetError, match="no path given; write fewrel:PATH, or fewrel alone"):
        load_dataset("fewrel:")
    with pytest.raises(DatasetError, match="no path given; write jsonl:PATH"):
        load_dataset("jsonl")
    with pytest.raises(DatasetError, match="known names: fewrel, lre, known1000, maps, codex-m"):
        registry.fetch("wikitext")
    assert mirror.requests == []


def test_public_urls_follow_the_provenance() -> None:
    """Each file's URL is its path at the pinned commit of the repository named in shared/data/README.md."""
    raw = "https://raw.githubusercontent.com"
    ds = registry.DATASETS
    assert (
        ds["fewrel"].url("fewrel/val_wiki.json")
        == f"{raw}/thunlp/FewRel/278a2315d2138810a379cd8d5718914dc56e2582/data/val_wiki.json"
    )
    assert (
        ds["lre"].url("lre_relations/data/bias/name_gender.json")
        == f"{raw}/evandez/relations/1b9ec3cf2b8368e42bde7e80fcef384312a6ec07/data/bias/name_gender.json"
    )
    assert ds["maps"].url("maps/datasets/adj_antonym/adj_antonym.json") == (
        f"{raw}/amitelhelo/MAPS/b320fcd972bab3e05f4a0b7d5d266641a0f1bcfe/datasets/adj_antonym/"
        "adj_antonym.json"
    )
    assert (
        ds["known1000"].url("known_1000/known_1000.json")
        == f"{raw}/khnhenriette/ProjectADL/6f1637bbf55cc8506e565513f31e24dda55b9858/dsets/known_1000.json"
    )
    assert (
        ds["codex-m"].url("codex_m/valid.txt")
        == f"{raw}/tsafavi/codex/3132e426c2a6b643b70bad679905a3a6270be440/data/triples/codex-m/valid.txt"
    )
    mirrored = ds["fewrel"].url("fewrel/val_wiki.json", "http://mirror/x/")
    assert mirrored == "http://mirror/x/fewrel/val_wiki.json"
    # every pinned file belongs to exactly one data set, under its folder
    owners = [name for path in SHA256 for name, d in ds.items() if path in d.files]
    assert len(owners) == len(SHA256)
    assert {name: len(d.files) for name, d in ds.items()} == {
        "fewrel": 2,
        "lre": 47,
        "known1000": 1,
        "maps": 20,
        "codex-m": 3,
    }


@pytest.mark.real_data
def test_pins_equal_the_public_files() -> None:
    """The pinned hashes are those of the copies in $ACTSTORE_DATA, and a fetch of a complete copy
    there returns it as it is."""
    for rel, pin in SHA256.items():
        assert sha256(real_data(rel)) == pin, rel
    for name, ds in registry.DATASETS.items():
        assert registry.fetch(name, data_dir=real_data(".")) == real_data(ds.entry)


def test_cli_ingest_by_name(mirror: Mirror, tmp_path: Path) -> None:
    """``actstore ingest --dataset fewrel`` on a tiny model, the data set fetched from the mirror."""
    from click.testing import CliRunner

    import actstore
    from actstore.cli import main

    args = [
        "ingest",
        "--model",
        "tiny-llama",
        "--dataset",
        "fewrel",
        "--relations",
        "P177",
        "--limit-per-relation",
        "4",
        "--batch-size",
        "4",
        "--segment-size",
        "4",
        "--quiet",
    ]
    r = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "store")])
    assert r.exit_code == 0, r.output
    assert len(mirror.requests) == 2
    want = load_fewrel(FIXTURES / "fewrel" / "val_wiki.json", relations=["P177"], limit_per_relation=4)
    store = actstore.open(tmp_path / "store")
    got = store.sql("SELECT text FROM examples ORDER BY example_id").column("text").to_pylist()
    assert got == [x.text for x in want.records]
    # offline and not cached: one error line naming the URL and the variable, exit status 1
    url = mirror.url
    mirror.close()
    offline = [
        "ingest",
        "--model",
        "tiny-llama",
        "--dataset",
        "lre",
        "--quiet",
        "--out",
        str(tmp_path / "offline"),
    ]
    r = CliRunner().invoke(main, offline)
    assert r.exit_code == 1
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1, r.output
    assert f"{url}/lre_relations/data/" in lines[0] and "ACTSTORE_DATA" in lines[0]
