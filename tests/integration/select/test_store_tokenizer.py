"""The model's tokenizer saved inside the store at ingest, and read back by the query layer.

The reference is the tokenizer the ingest ran with (``tiny_model(arch).tokenizer``): the one read from
the store must give the same ids, offsets and tokens for every prompt of the corpus and for text the
corpus never had.  The files are checked against the manifest's SHA-256; a store without them (one
ingested before tokenizers were saved) is one clear error in ``query`` and resolved by the facade
when its manifest names one of actstore's aliases.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import actstore
from actstore.api import tokenizer_for_store as facade_tokenizer
from actstore.core.errors import CorruptStoreError, QueryError
from actstore.core.manifest import seal
from actstore.core.tables import sha256
from actstore.core.verify import verify_store
from actstore.ingest.models.tiny import tiny_model
from actstore.query.select.store_tokenizer import stored_tokenizer

TEXTS = ["The capital of France is", "Zebras weren't seen; — naïve café 123", "", "  two  spaces\tand a tab"]


def same_tokenizer(a: object, b: object, texts: list[str]) -> None:
    assert len(a) == len(b)  # type: ignore[arg-type]
    for t in texts:
        ea = a(t, add_special_tokens=True, return_offsets_mapping=True)  # type: ignore[operator]
        eb = b(t, add_special_tokens=True, return_offsets_mapping=True)  # type: ignore[operator]
        assert ea["input_ids"] == eb["input_ids"], t
        assert ea["offset_mapping"] == eb["offset_mapping"], t
        assert a.convert_ids_to_tokens(ea["input_ids"]) == b.convert_ids_to_tokens(eb["input_ids"])  # type: ignore[attr-defined]
    assert a.pad_token_id == b.pad_token_id and a.bos_token_id == b.bos_token_id  # type: ignore[attr-defined]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_store_holds_the_ingest_tokenizer(store_factory: Callable[..., Path], arch: str) -> None:
    path = store_factory(arch)
    store = actstore.open(path)
    record = store.tokenizer_record()
    assert record, "the manifest records the tokenizer files"
    for name, digest in record.items():
        assert sha256((path / "tokenizer" / name).read_bytes()) == digest
    corpus = store.table("examples", ["text"]).column(0).to_pylist()
    same_tokenizer(stored_tokenizer(store), tiny_model(arch).tokenizer, TEXTS + corpus)
    # every stored token id of the corpus is what the stored tokenizer makes of the prompt's text
    tok = stored_tokenizer(store)
    ids = store.sql(
        "SELECT e.text, list(t.token_id ORDER BY t.position) AS ids FROM examples e "
        "JOIN tokens t USING (example_id) GROUP BY e.example_id, e.text"
    ).to_pylist()
    for row in ids:
        assert tok(row["text"])["input_ids"][: len(row["ids"])] == row["ids"]


def copy_store(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_model(path: Path, **changes: object) -> None:
    """Change fields of the manifest's ``model`` (None deletes one), sealed again with a valid checksum."""
    m = json.loads((path / "manifest.json").read_text())
    m.pop("checksum")
    for k, v in changes.items():
        if v is None:
            del m["model"][k]
        else:
            m["model"][k] = v
    (path / "manifest.json").write_text(json.dumps(seal(m)))


def without_tokenizer(path: Path, model_name: str | None = None) -> Path:
    """``path`` without its tokenizer: no ``tokenizer/``, no manifest record."""
    shutil.rmtree(path / "tokenizer")
    edit_model(path, tokenizer=None, **({} if model_name is None else {"name": model_name}))
    return path


def test_a_changed_tokenizer_file_is_refused(tiny_store: Path, tmp_path: Path) -> None:
    path = copy_store(tiny_store, tmp_path / "s")
    f = path / "tokenizer" / "tokenizer.json"
    f.write_bytes(f.read_bytes().replace(b'"<pad>"', b'"<PAD>"', 1))
    with pytest.raises(CorruptStoreError, match="tokenizer/tokenizer.json: SHA-256 does not match"):
        stored_tokenizer(actstore.open(path))


def test_verify_checks_every_tokenizer_file(tiny_store: Path, tmp_path: Path) -> None:
    """``verify`` hashes the tokenizer files: a clean store is ok; one changed byte and one deleted file
    are each named (both reported, not only the first); nothing else is flagged."""
    assert verify_store(actstore.open(tiny_store)).ok
    path = copy_store(tiny_store, tmp_path / "s")
    f = path / "tokenizer" / "tokenizer.json"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    (path / "tokenizer" / "tokenizer_config.json").unlink()
    report = verify_store(actstore.open(path))
    assert report.status == "CORRUPT"
    assert sorted(report.problems) == [
        "tokenizer/tokenizer.json: SHA-256 does not match the manifest's model.tokenizer",
        "tokenizer/tokenizer_config.json: missing (the manifest's model.tokenizer records it)",
    ]


def test_a_missing_tokenizer_file_is_refused(tiny_store: Path, tmp_path: Path) -> None:
    path = copy_store(tiny_store, tmp_path / "s")
    (path / "tokenizer" / "tokenizer_config.json").unlink()
    with pytest.raises(CorruptStoreError, match="tokenizer_config.json: missing"):
        stored_tokenizer(actstore.open(path))


@pytest.mark.parametrize(
    "bad",
    [{"files": {"../../etc/passwd": "0" * 64}}, {"files": {"a.json": "xyz"}}, {"files": {}}, "tokenizer"],
)
def test_a_malformed_manifest_record_is_refused(tiny_store: Path, tmp_path: Path, bad: object) -> None:
    path = copy_store(tiny_store, tmp_path / "s")
    edit_model(path, tokenizer=bad)
    with pytest.raises(CorruptStoreError, match="model.tokenizer"):
        stored_tokenizer(actstore.open(path))


def test_a_store_without_a_tokenizer_says_so(tiny_store: Path, tmp_path: Path) -> None:
    """Without a tokenizer (and its record) in the store, query and the facade say what is missing; the
    model the manifest names is not resolved on its own, an explicit alias still is."""
    old = actstore.open(without_tokenizer(copy_store(tiny_store, tmp_path / "old")))
    assert not old.has_tokenizer()
    for read in (stored_tokenizer, facade_tokenizer):
        with pytest.raises(QueryError, match="holds no tokenizer"):
            read(old)
    same_tokenizer(facade_tokenizer(old, "tiny-llama"), tiny_model("llama").tokenizer, TEXTS)


def test_an_explicit_tokenizer_folder_or_alias(tiny_store: Path, tmp_path: Path) -> None:
    store = actstore.open(tiny_store)
    ref = tiny_model("llama").tokenizer
    folder = tmp_path / "tok"
    ref.save_pretrained(folder)
    same_tokenizer(stored_tokenizer(store, str(folder)), ref, TEXTS)
    same_tokenizer(facade_tokenizer(store, "tiny-llama"), ref, TEXTS)
    big = tiny_model("llama").tokenizer
    big.add_tokens([f"extra{i}" for i in range(store.geometry.vocab_size)])
    big_folder = tmp_path / "big"
    big.save_pretrained(big_folder)
    with pytest.raises(QueryError, match="vocabulary of"):
        stored_tokenizer(store, str(big_folder))


def test_a_hub_tokenizer_offline_is_one_line_at_once(
    tiny_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub name the (empty) local cache lacks, with the hub unreachable (a closed port): one line
    naming why, after one connection try, not the hub client's retries."""
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for var in ("ACTSTORE_OFFLINE", "HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    start = time.monotonic()
    with pytest.raises(QueryError) as err:
        stored_tokenizer(actstore.open(tiny_store), "nobody/not-a-tokenizer-for-actstore")
    message = str(err.value)
    assert "\n" not in message and "nobody/not-a-tokenizer-for-actstore" in message
    assert f"127.0.0.1:{port} cannot be reached" in message
    assert time.monotonic() - start < 10  # one refused connection, where the hub client retries for ~30 s
    monkeypatch.setenv("ACTSTORE_OFFLINE", "1")
    with pytest.raises(QueryError, match="ACTSTORE_OFFLINE is set"):
        stored_tokenizer(actstore.open(tiny_store), "nobody/not-a-tokenizer-for-actstore")


def test_a_store_on_s3_keeps_and_serves_its_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Written and read through the storage layer: the same files on an S3-compatible server (moto)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from s3server import moto_server, use_server_env

    from actstore.ingest.align import tokenize_records
    from actstore.ingest.datasets.dispatch import load_dataset
    from actstore.ingest.pipeline import ingest_prompts
    from actstore.ingest.settings import IngestConfig

    with moto_server() as server:
        use_server_env(monkeypatch, server)
        loaded = tiny_model("llama")
        prompts = tokenize_records(load_dataset("demo", limit_per_relation=1).records, loaded.tokenizer)
        url = f"s3://{server.bucket}/stores/tok"
        cfg = IngestConfig(out=url, batch_size=4, segment_size=8, chunk_rows=4, chunk_flat=64, progress=False)
        ingest_prompts(
            loaded.model,
            loaded.tokenizer,
            {"name": loaded.name, "weight_hash": loaded.weight_hash},
            prompts,
            cfg,
        )
        store = actstore.open(url)
        assert store.has_tokenizer() and not store.location.paths_open_directly()
        same_tokenizer(stored_tokenizer(store), loaded.tokenizer, TEXTS)
