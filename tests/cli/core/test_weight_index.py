"""The shared weights cache's index (ours): a second store of the same model takes its weights' content
hash from the index instead of extracting and hashing the weights again; a changed model file is
extracted and hashed again; an index entry that is corrupt, or whose shared copy is gone, is not
trusted. Every record is checked against a fresh extraction hashed here, and against ``verify``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import zarr
from click.testing import CliRunner

from actstore.cli import main
from actstore.core.storage import locate
from actstore.core.weight_store import INDEX_DIR, content_hash, group_hash, read_record
from actstore.ingest.capture.architectures import Architecture, architecture_for
from actstore.ingest.models.registry import load_model
from actstore.ingest.models.tiny import tiny_model
from actstore.jobs.import_acts import write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.tensor([[1, 5, 9, 12, 3, 7]])


@pytest.fixture
def extractions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The architectures' weight extractions this test runs (one entry a call)."""
    calls: list[str] = []
    real = Architecture.weights

    def counted(self: Architecture, model: Any) -> Any:
        calls.append(self.name)
        return real(self, model)

    monkeypatch.setattr(Architecture, "weights", counted)
    return calls


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A tiny llama saved as a model folder (what ``--model PATH`` loads)."""
    folder = tmp_path / "model"
    loaded = tiny_model("llama")
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


def fresh_hash(model: str) -> str:
    """The content hash of ``model``'s weights, extracted and hashed here from a fresh load."""
    loaded = load_model(model)
    weights, attrs = architecture_for(loaded.model).weights(loaded.model)
    return content_hash(weights, attrs)


def imported(out: Path, model: str, weights: str = "shared") -> Any:
    acts = {"blocks.1.hook_resid_pre": torch.randn(1, IDS.shape[1], 64)}
    write_corpus(out, acts, tokens=IDS, model=model, weights=weights, predict=False)
    record = read_record(locate(str(out)))
    assert record is not None
    return record


def verify_ok(store: Path) -> None:
    r = CliRunner().invoke(main, ["verify", str(store)])
    assert r.exit_code == 0, r.output


def test_a_second_store_takes_the_hash_from_the_index(
    tmp_path: Path, cache: Path, extractions: list[str], model_dir: Path
) -> None:
    first = imported(tmp_path / "a", str(model_dir))
    assert extractions == ["llama"] and first.mode == "shared"
    assert first.sha256 == fresh_hash(str(model_dir)) and len(extractions) == 2  # (the fresh one here)
    assert len(list((cache / INDEX_DIR).iterdir())) == 1
    second = imported(tmp_path / "b", str(model_dir))
    assert len(extractions) == 2  # not extracted, not hashed: the record from the index
    assert second == first
    verify_ok(tmp_path / "b")
    # none takes the hash from the index too; copy needs the arrays, and is extracted
    assert imported(tmp_path / "n", str(model_dir), "none").sha256 == first.sha256 and len(extractions) == 2
    assert imported(tmp_path / "c", str(model_dir), "copy").sha256 == first.sha256 and len(extractions) == 3
    verify_ok(tmp_path / "c")


def test_a_changed_model_file_is_hashed_again(
    tmp_path: Path, cache: Path, extractions: list[str], model_dir: Path
) -> None:
    first = imported(tmp_path / "a", str(model_dir))
    loaded = load_model(str(model_dir))
    with torch.no_grad():  # one weight of the attention output changed, saved over the same files
        loaded.model.model.layers[0].self_attn.o_proj.weight[0, 0] += 1.0
    loaded.model.save_pretrained(model_dir)
    n = len(extractions)
    changed = imported(tmp_path / "b", str(model_dir))
    assert len(extractions) == n + 1 and changed.sha256 != first.sha256
    assert changed.sha256 == fresh_hash(str(model_dir))
    assert group_hash(zarr.open_group(str(cache / changed.sha256), mode="r")) == changed.sha256
    assert len(list((cache / INDEX_DIR).iterdir())) == 2
    for name in ("a", "b"):
        verify_ok(tmp_path / name)


@pytest.mark.parametrize("damage", ["garbage", "tampered", "copy gone"])
def test_an_index_entry_not_to_trust_is_not_trusted(
    tmp_path: Path, cache: Path, extractions: list[str], damage: str
) -> None:
    first = imported(tmp_path / "a", "tiny-llama")
    (entry,) = (cache / INDEX_DIR).iterdir()
    if damage == "garbage":
        entry.write_bytes(b"\x00not json")
    elif damage == "tampered":  # another hash, the checksum left as it was
        entry.write_text(entry.read_text().replace(first.sha256, "0" * 64))
    else:
        import shutil

        shutil.rmtree(cache / first.sha256)
    again = imported(tmp_path / "b", "tiny-llama")
    assert len(extractions) == 2 and again.sha256 == first.sha256
    assert (cache / first.sha256 / "zarr.json").is_file()
    verify_ok(tmp_path / "b")
    assert imported(tmp_path / "c", "tiny-llama") == again and len(extractions) == 2  # mended
