"""Stores of one model share one content-addressed copy of the weights (``--weights shared``, the
default), or carry their own (``copy``), or none (``none``): bytes counted with ``os.stat``, readings of
a shared store equal to a copy store's bit for bit, refusals in one line, ``verify`` checking the copy a
store uses, ``weights materialise``, and two ingests writing the same cache at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import build_store

import actstore
from actstore.cli import main
from actstore.core.sizes import human_size, store_size
from actstore.core.storage import locate
from actstore.core.weight_store import INDEX_DIR, RECORD, content_hash, read_record, store_weights

pytestmark = pytest.mark.usefixtures("one_thread")


def du(root: Path) -> int:
    """Bytes of every regular file under ``root`` (a plain walk with os.stat, as du counts them)."""
    total = 0
    for here, _, files in os.walk(root):
        for f in files:
            total += os.stat(os.path.join(here, f)).st_size
    return total


def run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args))
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), r.exception
    return r.exit_code, r.stdout, r.stderr


def one_line(code: int, stderr: str) -> str:
    assert code != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


@pytest.fixture
def stores(tmp_path: Path, cache: Path) -> dict[str, Path]:
    return {
        "shared1": build_store(tmp_path / "shared1", weights="shared"),
        "shared2": build_store(tmp_path / "shared2", weights="shared"),
        "copy": build_store(tmp_path / "copy", weights="copy"),
        "none": build_store(tmp_path / "none", weights="none"),
    }


def test_two_stores_of_one_model_share_one_copy(stores: dict[str, Path], cache: Path) -> None:
    copies = sorted(p.name for p in cache.iterdir() if p.is_dir() and p.name != INDEX_DIR)
    assert len(copies) == 1 and len(copies[0]) == 64  # one folder, named by the content hash
    shared = cache / copies[0]
    for name in ("shared1", "shared2", "none"):
        assert not (stores[name] / "weights").exists()
        assert read_record(locate(str(stores[name]))).sha256 == (copies[0] if name != "none" else copies[0])
    own = du(stores["copy"] / "weights")
    assert own > 0 and du(shared) == own  # the shared copy is the same group a copy store holds
    # the store without weights is smaller than the copy store by exactly its weights (+ the record's bytes)
    rest_copy = du(stores["copy"]) - own - os.stat(stores["copy"] / RECORD).st_size
    rest_shared = du(stores["shared1"]) - os.stat(stores["shared1"] / RECORD).st_size
    assert abs(rest_copy - rest_shared) < own // 10
    # info says where the weights are and how big, on its own line
    code, out, _ = run("info", str(stores["shared1"]), "--json")
    d = json.loads(out)
    assert code == 0 and d["weights_where"] == "shared" and d["weights_bytes"] == 0
    assert d["weights_shared_bytes"] == du(shared) and d["weights_shared_path"] == str(shared)
    text = run("info", str(stores["none"]))[1]
    assert "weights   none (ingested with --weights none" in text
    # the explorer's store page and the report's summary say the same line
    from actstore.serve.views import store_summary

    opened = actstore.open(str(stores["shared1"]))
    page = store_summary(opened)
    assert page["weights_bytes"] == 0 and page["weights_size"] == store_size(opened).weights_line()
    assert (
        page["weights_size"].startswith(human_size(du(shared)) + " shared")
        and str(shared) in page["weights_size"]
    )


def test_a_shared_store_reads_what_a_copy_store_reads(stores: dict[str, Path]) -> None:
    a, b = actstore.open(str(stores["shared1"])), actstore.open(str(stores["copy"]))
    assert a.weights_source is not None and a.weights_source.kind == "shared"
    assert b.weights_source is not None and b.weights_source.kind == "store"
    names = ("W_O", "b_O", "W_V", "W_down", "embed", "unembed", "final_norm_weight")
    for name in names:
        x, y = a.weight(name), b.weight(name)
        assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), name
    assert a.weight_attrs == b.weight_attrs
    for kind in ("attn_head", "attn", "mlp"):  # z W_O, its sum over heads, the MLP out through W_down
        x, y = a.select().features(kind), b.select().features(kind)
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), kind
    # the logit lens (the residual through the final norm and the unembedding) reads the same numbers
    lens = [
        run("lens", str(stores[n]), "--no-tuned", "--no-save", "--json", "--quiet")
        for n in ("shared1", "copy")
    ]
    assert lens[0][0] == lens[1][0] == 0
    curves = [json.loads(out)["per_index"] for _, out, _ in lens]
    assert len(curves[0]) == 3 and curves[0] == curves[1]  # every index's KL, probability and rank, exactly
    # and the shared store's attn_head is z @ W_O computed here by plain loops over heads
    z = a.select().features("z")  # [N, L, H, d_head]
    W_O = a.weight("W_O")  # [L, H, d_head, d_model]
    head = a.select().features("attn_head")
    want = np.stack([[z[:, i, h] @ W_O[i, h] for h in range(W_O.shape[1])] for i in range(W_O.shape[0])])
    assert np.allclose(head, want.transpose(2, 0, 1, 3), atol=1e-5)


def test_a_store_without_weights_refuses_what_needs_them(stores: dict[str, Path], tmp_path: Path) -> None:
    none = str(stores["none"])
    line = one_line(*run("features", none, "--kind", "attn_head", "--out", str(tmp_path / "x.npy"))[::2])
    assert "--weights none" in line and "needs the model's weights" in line
    assert not (tmp_path / "x.npy").exists()
    code, out, _ = run("features", none, "--kind", "z", "--out", str(tmp_path / "z.npy"))  # z needs none
    assert code == 0 and np.load(tmp_path / "z.npy").shape[0] == actstore.open(none).n_rows
    code, out, _ = run("verify", none)
    assert code == 0 and out.startswith("ok")


def test_verify_names_a_corrupt_shared_copy(stores: dict[str, Path], cache: Path) -> None:
    shared = next(p for p in cache.iterdir() if p.is_dir())
    assert run("verify", str(stores["shared1"]))[0] == 0
    chunk = shared / "W_O" / "c" / "1" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[7] ^= 0xFF
    chunk.write_bytes(bytes(data))
    code, out, err = run("verify", str(stores["shared1"]))
    assert code == 3 and out.startswith("CORRUPT")
    assert f"{shared}/W_O: chunk 1 (rows 1:2, layer 1) is corrupt" in err, err
    # a flip the chunk checksums do not see (the group's attributes) is caught by the content hash
    chunk.write_bytes(bytes(data[:7] + bytes([data[7] ^ 0xFF]) + data[8:]))
    assert run("verify", str(stores["shared1"]))[0] == 0
    meta = shared / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["final_norm_eps"] = 0.5
    meta.write_text(json.dumps(doc))
    code, _, err = run("verify", str(stores["shared1"]))
    assert code == 3 and f"{shared}: the weights' sha256" in err, err


def test_materialise_then_delete_the_cache(stores: dict[str, Path], cache: Path, tmp_path: Path) -> None:
    path = stores["shared2"]
    before = actstore.open(str(path)).select().features("attn_head")
    (path / "weights").mkdir()  # the remains of a materialise killed before it rewrote weights.json:
    (path / "weights" / "zarr.json").write_text("{}")  # the record still says shared, and readers obey it
    again = actstore.open(str(path)).select().features("attn_head")
    assert np.array_equal(before.view(np.uint8), again.view(np.uint8))
    code, out, _ = run("weights", "materialise", str(path))
    assert code == 0 and "copied the weights" in out
    for p in cache.iterdir():  # the cache is gone: the store holds its own copy now
        if p.is_dir():
            for here, _, files in os.walk(p, topdown=False):
                for f in files:
                    os.remove(os.path.join(here, f))
                os.rmdir(here)
    moved = tmp_path / "moved"
    os.rename(path, moved)
    s = actstore.open(str(moved))
    after = s.select().features("attn_head")
    assert np.array_equal(before.view(np.uint8), after.view(np.uint8))
    assert run("verify", str(moved))[0] == 0
    assert run("weights", "materialise", str(moved))[1].strip().endswith("in the store already")
    # a store whose shared copy is gone refuses in one line, naming the ways out
    line = one_line(*run("features", str(stores["shared1"]), "--kind", "attn_head", "--out", "x.npy")[::2])
    assert "actstore weights materialise" in line and "--weights copy" in line
    code, _, err = run("verify", str(stores["shared1"]))
    assert code == 3 and "neither in the store nor in the shared cache" in err
    line = one_line(*run("weights", "materialise", str(stores["shared1"]))[::2])
    assert "neither in the store nor in the shared cache" in line


def test_a_bad_weights_choice_is_a_usage_error(tmp_path: Path) -> None:
    code, _, err = run("ingest", "--model", "tiny-llama", "--weights", "some", "--out", str(tmp_path / "s"))
    assert code == 2 and "--weights" in err and not (tmp_path / "s").exists()


def test_a_remote_store_gets_a_copy(cache: Path) -> None:
    """A store others read elsewhere (any non-local URL) cannot refer to this machine's cache."""
    loc = locate("memory://weights-remote/s")
    w = {"W_O": np.arange(24, dtype=np.float32).reshape(2, 3, 4), "embed": np.ones((5, 4), np.float32)}
    record = store_weights(loc, w, {"tied_unembed": True}, 2, "shared")
    assert record.mode == "copy" and loc.exists("weights/zarr.json") and not cache.exists()
    assert record.sha256 == content_hash(w, {"tied_unembed": True})
    assert content_hash({**w, "embed": w["embed"] * 2}, {"tied_unembed": True}) != record.sha256


def test_two_ingests_write_the_same_cache_at_once(tmp_path: Path, cache: Path) -> None:
    args = ["--model", "tiny-llama", "--dataset", "demo", "--limit-per-relation", "1"]
    env = {**os.environ, "ACTSTORE_WEIGHTS_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "actstore.cli", "ingest", *args, "--quiet", "--out", str(tmp_path / n)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in ("a", "b")
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    entries = sorted(p.name for p in cache.iterdir())
    folders = [e for e in entries if (cache / e).is_dir() and e != INDEX_DIR]
    assert len(folders) == 1 and not [e for e in entries if e.startswith(".tmp-")], entries
    for n in ("a", "b"):
        assert run("verify", str(tmp_path / n))[0] == 0


@pytest.mark.parametrize("mode", ["copy", "none"])
def test_an_import_puts_the_weights_where_asked(tmp_path: Path, cache: Path, mode: str) -> None:
    """``actstore import`` (``write_corpus``) writes weights as ``ingest`` does: here a copy, or none."""
    import torch

    from actstore.jobs.import_acts import write_corpus

    ids = torch.tensor([[1, 5, 9, 12]])
    report = write_corpus(
        tmp_path / "s", {"blocks.0.hook_resid_pre": torch.randn(1, 4, 64)}, tokens=ids, weights=mode
    )
    assert report.n_examples == 4
    record = read_record(locate(str(tmp_path / "s")))
    assert record is not None and record.mode == mode
    assert (tmp_path / "s" / "weights").is_dir() == (mode == "copy") and not cache.exists()


def _share_at_once(cache: str, start: float, out: str) -> None:
    """One writer of the race below: waits until ``start``, then shares the same 16 MB of weights."""
    import time

    from actstore.core.weight_store import share

    os.environ["ACTSTORE_WEIGHTS_DIR"] = cache
    w = {"W_down": np.arange(2 * 1024 * 2048, dtype=np.float32).reshape(2, 1024, 2048)}
    digest = content_hash(w, {})
    time.sleep(max(0.0, start - time.time()))
    Path(out).write_text(str(share(w, {}, 2, digest)))


def test_writers_racing_for_one_copy_leave_one_whole_copy(tmp_path: Path, cache: Path) -> None:
    """Processes sharing the same weights at the same moment: each gets the same folder, holding the
    whole copy (its content hash is the one they wrote), and no temporary folder is left."""
    import multiprocessing
    import time

    import zarr

    from actstore.core.weight_store import group_hash

    ctx = multiprocessing.get_context("spawn")
    start = time.time() + 4.0  # after the interpreters have started
    procs = [
        ctx.Process(target=_share_at_once, args=(str(cache), start, str(tmp_path / f"out{i}")))
        for i in range(3)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    folders = {(tmp_path / f"out{i}").read_text() for i in range(3)}
    assert len(folders) == 1
    folder = Path(folders.pop())
    w = {"W_down": np.arange(2 * 1024 * 2048, dtype=np.float32).reshape(2, 1024, 2048)}
    assert folder.name == content_hash(w, {})
    assert group_hash(zarr.open_group(str(folder), mode="r")) == folder.name
    assert sorted(p.name for p in cache.iterdir()) == [folder.name, f"{folder.name}.lock"]
