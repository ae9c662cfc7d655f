"""The field's training tools with their real packages (sae-lens, dictionary-learning, eai-sparsify):
Selection.to_hf_dataset(context_size=N) is what SAELens's own CacheActivationsRunner writes for the
same model, hook and windows, SAELens's training runner trains from it as it is, and
Selection.loader(epochs=None) feeds trainSAE, SAETrainer and a SparseCoder loop; docs/interop.md's
training snippets run as written."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import quiet

import actstore
from actstore.core.errors import QueryError
from actstore.ingest.models.tiny import tiny_model

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    # the tools' imports warn about their own dependencies (TransformerLens's deprecated utils, ...)
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
N = 8  # the windows' context size
DOC = Path(__file__).resolve().parents[3] / "docs" / "interop.md"
DOCS = [
    "the quiet river runs past an old stone bridge and the road goes on",
    "a red house stands on the hill near the lake",
    "kings and queens of the north built great halls",
] * 4


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``model`` (a tiny Llama saved with its tokenizer), ``docs`` (the corpus as a datasets text
    folder) and ``corpus`` (a packed store of whole windows of N kept positions, float16)."""
    t = tmp_path_factory.mktemp("interop")
    m = tiny_model("llama")
    m.model.save_pretrained(t / "model")
    m.tokenizer.save_pretrained(t / "model")
    (t / "docs").mkdir()
    (t / "docs" / "train.txt").write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    with quiet():
        actstore.ingest_corpus(
            t / "corpus",
            model=str(t / "model"),
            dataset=f"text:{t / 'docs' / 'train.txt'}",
            positions="all",
            kinds=("resid",),
            pack=True,
            keep_special=True,
            context_length=N,
            batch_size=4,
            segment_size=16,
        )
    return t


@pytest.fixture
def cwd(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("model", "docs", "corpus"):
        (tmp_path / name).symlink_to(home / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def windows(store: Any) -> list[list[int]]:
    pos = store.sql("SELECT window_index, token_id FROM positions ORDER BY row", format="pandas")
    return [g.token_id.tolist() for _, g in pos.groupby("window_index", sort=True) if len(g) == N]


def test_the_export_is_what_saelens_cache_runner_writes(home: Path, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig

    store = actstore.open(home / "corpus")
    wins = windows(store)
    d = store.geometry.d_model
    with quiet():
        ds = store.select().to_hf_dataset(tmp_path / "ours", "resid", layers=[1], context_size=N)
        cfg = CacheActivationsRunnerConfig(
            dataset_path="unused",  # override_dataset: the store's windows, pre-tokenized
            model_name=str(home / "model"),
            model_class_name="AutoModelForCausalLM",
            model_batch_size=4,
            hook_name="model.layers.0",
            d_in=d,
            training_tokens=len(wins) * N,
            context_size=N,
            new_cached_activations_path=str(tmp_path / "theirs"),
            device="cpu",
            prepend_bos=False,  # each window starts with BOS already
            buffer_size_gb=len(wins) * N * d * 4 / 1e9,  # one shard of every window
        )
        CacheActivationsRunner(cfg, override_dataset=datasets.Dataset.from_dict({"input_ids": wins})).run()
    ref = datasets.Dataset.load_from_disk(str(tmp_path / "theirs"))  # as written, not as returned
    # the folder is what save_to_disk writes for that dataset (its metadata files written directly)
    datasets.Dataset.load_from_disk(str(tmp_path / "ours")).save_to_disk(str(tmp_path / "resaved"))
    for name in ("state.json", "dataset_info.json"):
        mine, saved = (json.loads((tmp_path / f / name).read_text()) for f in ("ours", "resaved"))
        assert mine.keys() == saved.keys()
        mine.pop("_fingerprint", None), saved.pop("_fingerprint", None)
        assert mine == saved
    # what it returns is the dataset load_from_disk opens there (made without reading it back)
    loaded = datasets.Dataset.load_from_disk(str(tmp_path / "ours"))
    assert (ds.info, ds.split, ds.format, ds.cache_files) == (
        loaded.info,
        loaded.split,
        loaded.format,
        loaded.cache_files,
    )
    assert type(ds.data) is type(loaded.data) and ds.data.table.equals(loaded.data.table)
    state = json.loads((tmp_path / "ours" / "state.json").read_text())
    assert ds._fingerprint == state["_fingerprint"]
    assert ds.column_names == ref.column_names == ["model.layers.0", "token_ids"]
    assert ds.features == ref.features
    assert ds.num_rows == ref.num_rows == len(wins)
    assert ds["token_ids"] == ref["token_ids"] == wins
    a = ds.with_format("numpy")[:]["model.layers.0"]
    b = ref.with_format("numpy")[:]["model.layers.0"]
    assert a.shape == b.shape == (len(wins), N, d) and a.dtype == b.dtype == np.float32
    # the store keeps float16: within half a float16 ulp of the runner's float32
    half_ulp = np.spacing(np.abs(b).astype(np.float16)).astype(np.float32) / 2
    assert np.all(np.abs(a - b) <= half_ulp + 1e-7)
    half = store.select().to_hf_dataset(
        tmp_path / "half", "resid", layers=[1], context_size=N, dtype="float16"
    )
    assert np.array_equal(half.with_format("numpy")[:]["model.layers.0"], a.astype(np.float16))
    again = store.select().to_hf_dataset(
        tmp_path / "shuf", "resid", layers=[1], context_size=N, shuffle=True, seed=3
    )
    order = datasets.Dataset.from_dict({"i": list(range(len(wins)))}).shuffle(seed=3)["i"]
    assert again["token_ids"] == [wins[i] for i in order]


def test_bad_exports_are_one_line_and_leave_nothing(home: Path, tmp_path: Path, store_factory: Any) -> None:
    pytest.importorskip("datasets")
    sel = actstore.open(home / "corpus").select()
    hint = "--pack --keep-special --context-length 16"
    with pytest.raises(QueryError, match=hint):
        sel.to_hf_dataset(tmp_path / "a", "resid", layers=[1], context_size=16)
    with pytest.raises(QueryError, match="--positions all --pack --keep-special --context-length 8"):
        actstore.open(store_factory("llama", limit=2)).select().to_hf_dataset(
            tmp_path / "b", "resid", layers=[1], context_size=N
        )
    from actstore.query.select.hf_export import module_path

    for kind, arch in (("z", "llama"), ("resid", "mamba"), ("attn_head", "gpt2")):  # no naming known
        with pytest.raises(QueryError, match="hook_name="):
            module_path(kind, 1, arch)
    assert module_path("resid", 0, "llama") == "model.embed_tokens"
    assert module_path("mlp", 2, "gpt2") == "transformer.h.2.mlp"
    with pytest.raises(QueryError, match="ragged source axis"):
        sel.to_hf_dataset(tmp_path / "d", "attn_prob", context_size=N)
    with pytest.raises(QueryError, match="one layer"):
        sel.to_hf_dataset(tmp_path / "e", "resid", layers=[0, 1], context_size=N)
    named = sel.to_hf_dataset(
        tmp_path / "f", "resid", layers=[1], context_size=N, hook_name="blocks.1.hook_resid_pre"
    )
    assert named.column_names == ["blocks.1.hook_resid_pre", "token_ids"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # no half-written folder
    # an export stopped while it writes (here: the disk fills at its second block) leaves nothing either
    import actstore.query.select.hf_export as hf_export

    real, calls = hf_export.compute_block, []

    def fills(*a: Any, **k: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_export, "compute_block", fills)
        with pytest.raises(OSError, match="No space"):
            sel.to_hf_dataset(tmp_path / "g", "resid", layers=[1], context_size=N, batch_rows=N)
    assert len(calls) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_missing_client_is_one_line(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(QueryError, match=r"pip install 'actstore\[hf\]'"):
        actstore.open(home / "corpus").select().to_hf_dataset(
            tmp_path / "x", "resid", layers=[1], context_size=N
        )
    assert not (tmp_path / "x").exists()


def test_trainsae_runs_the_steps_it_asks_for(home: Path) -> None:
    from dictionary_learning import AutoEncoder
    from dictionary_learning.trainers import StandardTrainer
    from dictionary_learning.training import trainSAE

    calls: list[int] = []

    class Counted(StandardTrainer):  # type: ignore[misc]
        def update(self, step: int, x: Any) -> None:
            calls.append(x.shape[0])
            super().update(step, x)

    feed = (
        actstore.open(home / "corpus")
        .select()
        .loader("resid", layers=[1], batch_size=64, epochs=None, flatten=True)
    )
    steps = 3 * len(feed) + 1  # more than one epoch
    cfg = dict(
        trainer=Counted,
        dict_class=AutoEncoder,
        activation_dim=64,
        dict_size=128,
        lr=1e-3,
        device="cpu",
        steps=steps,
        layer=1,
        lm_name="model",
        warmup_steps=2,
        sparsity_warmup_steps=2,
    )
    with quiet():
        trainSAE(data=feed, trainer_configs=[cfg], steps=steps, device="cpu")
    assert len(calls) == steps and feed.epoch >= 3


def test_saelens_sae_trainer_trains_from_the_loader(home: Path) -> None:
    import torch
    from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig

    feed = (
        actstore.open(home / "corpus")
        .select()
        .loader("resid", layers=[1], batch_size=64, epochs=None, flatten=True)
    )
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=64, d_sae=128))
    before = sae.W_enc.detach().clone()
    steps = 2 * len(feed) + 3
    with quiet():
        SAETrainer(
            SAETrainerConfig(total_training_samples=64 * steps, train_batch_size_samples=64, lr_end=3e-4),
            sae,
            data_provider=feed,
        ).fit()
    assert not torch.equal(before, sae.W_enc.detach())
    assert feed.epoch >= 2


def snippets(section: str) -> list[str]:
    body = re.split(r"^## ", DOC.read_text(), flags=re.M)
    part = next(b for b in body if b.startswith(section + "\n"))
    return re.findall(r"```python\n(.*?)```", part, flags=re.S)


@pytest.mark.parametrize(
    "section",
    [
        "Training: SAELens's cache is the export",
        "Training: dictionary_learning's trainSAE",
        "Training: SAELens's SAETrainer from the loader",
        "Training: sparsify's SparseCoder in a plain loop",
    ],
)
def test_the_training_snippets_run_as_written(section: str, cwd: Path) -> None:
    blocks = snippets(section)
    assert blocks
    for k, code in enumerate(blocks):
        script = cwd / f"snippet_{k}.py"
        script.write_text(code)
        with quiet():
            runpy.run_path(str(script), run_name="__main__")
