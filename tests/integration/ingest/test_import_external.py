"""actstore.write_corpus: a TransformerLens cache, nnsight saves and vLLM extract_hidden_states files
written into a corpus store equal actstore's own corpus ingest of the same windows (docs/interop.md)."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiny_text_corpus

import actstore
from actstore.core.errors import InvalidSetting
from actstore.ingest.corpus_windows import plan_corpus
from actstore.ingest.datasets.text_corpus import load_documents
from actstore.ingest.models.registry import load_model
from actstore.jobs.import_acts import write_corpus

RTOL = 1e-5  # float32 computed by two code paths (docs/testing.md, Tolerances), relative to each layer's largest entry


def vllm_file(path: Path, token_ids: np.ndarray, hidden: np.ndarray) -> Path:
    """A file as vLLM's ExampleHiddenStatesConnector writes one request (vllm-project/vllm 015a95c8):
    ``hidden_states`` [seq, n_layer_ids, d] in the model dtype and ``token_ids`` int64 [seq]."""
    from safetensors.torch import save_file

    save_file(
        {"hidden_states": torch.from_numpy(hidden).contiguous(), "token_ids": torch.from_numpy(token_ids)},
        str(path),
    )
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[actstore.Store, list[np.ndarray], object]:
    """actstore's corpus ingest of a tiny text corpus, its windows' token ids and the loaded model."""
    out = tmp_path_factory.mktemp("ref") / "corpus"
    store = tiny_text_corpus(out, docs=6)
    loaded = load_model("tiny-llama")
    docs = load_documents(f"text:{out.parent / 'corpus.txt'}")
    plan = plan_corpus(
        docs, loaded.tokenizer, context_length=2048, keep_special=False, pack=False, separator=None
    )
    return store, [w.ids for w in plan.windows], loaded


def by_position(store: actstore.Store, layers: list[int]) -> dict[tuple[int, int], np.ndarray]:
    """Each row's residual at ``layers`` keyed by (document, window position)."""
    rows = store.sql("SELECT row, document, window_position FROM positions ORDER BY row").to_pylist()
    x = store.select().features("resid", layers=layers)
    return {(r["document"], r["window_position"]): x[i] for i, r in enumerate(rows)}


def assert_same_resid(ours: actstore.Store, ref: actstore.Store, layers: list[int]) -> None:
    a, b = by_position(ours, layers), by_position(ref, layers)
    assert set(b) <= set(a)  # the ingest drops BOS; the import keeps every position
    got = np.stack([a[k] for k in sorted(b)])
    want = np.stack([b[k] for k in sorted(b)])
    for j in range(len(layers)):
        scale = np.abs(want[:, j]).max()
        np.testing.assert_allclose(got[:, j], want[:, j], rtol=0, atol=RTOL * scale)


def tl_model(loaded: object) -> object:
    """A HookedTransformer holding tiny-llama's weights (TransformerLens 3.9's own Llama conversion)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights

    hf = loaded.model.config  # type: ignore[attr-defined]
    d_head = hf.hidden_size // hf.num_attention_heads
    cfg = HookedTransformerConfig(
        d_model=hf.hidden_size, d_head=d_head, n_heads=hf.num_attention_heads, d_mlp=hf.intermediate_size,
        n_layers=hf.num_hidden_layers, n_ctx=hf.max_position_embeddings, eps=hf.rms_norm_eps,
        d_vocab=hf.vocab_size, act_fn=hf.hidden_act, normalization_type="RMS",
        n_key_value_heads=hf.num_key_value_heads if hf.num_key_value_heads != hf.num_attention_heads else None,
        positional_embedding_type="rotary", rotary_adjacent_pairs=False, rotary_dim=d_head,
        rotary_base=(hf.rope_parameters or {}).get("rope_theta", 10000.0), final_rms=True, gated_mlp=True,
        default_prepend_bos=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # HookedTransformer: deprecated for 4.0's bridge
        tl = HookedTransformer(cfg)
    tl.load_and_process_state_dict(
        convert_llama_weights(loaded.model, cfg),  # type: ignore[attr-defined]
        fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False,
    )  # fmt: skip
    return tl


def test_transformer_lens_cache(reference: tuple, tmp_path: Path) -> None:
    ref, windows, loaded = reference
    tl = tl_model(loaded)
    L = loaded.model.config.num_hidden_layers
    tokens = [torch.from_numpy(ids)[None] for ids in windows]
    runs = [tl.run_with_cache(t) for t in tokens]  # one run_with_cache a window (they differ in length)
    report = write_corpus(tmp_path / "tl", [c for _, c in runs], tokens=tokens, model="tiny-llama")
    assert report.n_examples == sum(w.size for w in windows)
    ours = actstore.open(tmp_path / "tl")
    assert_same_resid(ours, ref, list(range(L + 1)))
    # the predictions: the model's head over the last residual, as TransformerLens's own logits say
    top = ours.sql("SELECT top_token_id FROM targets ORDER BY example_id").column(0).to_numpy()
    np.testing.assert_array_equal(top, torch.cat([lg[0].argmax(-1) for lg, _ in runs]).numpy())


def test_nnsight_saves(reference: tuple, tmp_path: Path) -> None:
    from nnsight import TransformersModel

    ref, windows, loaded = reference
    nm = TransformersModel(loaded.model, tokenizer=loaded.tokenizer)
    L = loaded.model.config.num_hidden_layers
    for k, ids in enumerate(windows[:2]):
        saves: dict[str, torch.Tensor] = {}  # created outside the trace, filled inside (nnsight 0.8)
        with torch.inference_mode(), nm.trace(input_ids=torch.from_numpy(ids)[None]):
            saves["model.embed_tokens"] = nm.model.embed_tokens.output.save()
            for i in range(L):  # block outputs: residual i + 1 (the last one before the final norm)
                saves[f"model.layers.{i}"] = nm.model.layers[i].output.save()
        write_corpus(tmp_path / f"nn{k}", dict(saves), tokens=torch.from_numpy(ids)[None], model="tiny-llama")
        ours = actstore.open(tmp_path / f"nn{k}")
        rows = (
            ref.sql("SELECT row FROM positions WHERE document = ? ORDER BY row", [k]).column("row").to_numpy()
        )
        want = ref.select().features("resid", layers=list(range(L + 1)))[rows]
        got = ours.select().features("resid", layers=list(range(L + 1)))[1:]  # the ingest drops BOS
        np.testing.assert_allclose(got, want, rtol=0, atol=RTOL * np.abs(want).max())


def test_vllm_files(reference: tuple, tmp_path: Path) -> None:
    ref, windows, loaded = reference
    L = loaded.model.config.num_hidden_layers
    layer_ids = [1, 0, L]  # vLLM keeps the order of eagle_aux_hidden_state_layer_ids
    folder = tmp_path / "hs"
    folder.mkdir()
    for k, ids in enumerate(windows):
        with torch.no_grad():
            hs = loaded.model(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
        pre_norm = list(hs[:L]) + [None]
        final = ref.select()  # residual L (before the final norm) is not in hidden_states: take the ingest's
        rows = (
            ref.sql("SELECT row FROM positions WHERE document = ? ORDER BY row", [k]).column("row").to_numpy()
        )
        last = np.concatenate(
            [np.zeros((1, hs[0].shape[-1]), np.float32), final.features("resid", layers=[L])[rows, 0]]
        )
        layers = [pre_norm[i][0].numpy() if i < L else last for i in layer_ids]
        vllm_file(folder / f"req-{k:03d}.safetensors", ids, np.stack(layers, 1))
    write_corpus(tmp_path / "v", folder, layer_ids=layer_ids, model="tiny-llama")
    assert_same_resid(actstore.open(tmp_path / "v"), ref, [0, 1])


def test_bad_shapes_write_nothing(reference: tuple, tmp_path: Path) -> None:
    _, windows, loaded = reference
    ids = torch.from_numpy(windows[0])[None]
    d = loaded.model.config.hidden_size
    with pytest.raises(InvalidSetting, match=r"the model's is \[\d+, 64\]"):
        write_corpus(
            tmp_path / "bad", {"blocks.0.hook_resid_pre": torch.zeros(1, ids.shape[1], d + 1)}, tokens=ids
        )
    with pytest.raises(InvalidSetting, match="past the model"):
        write_corpus(
            tmp_path / "bad", {"blocks.7.hook_resid_post": torch.zeros(1, ids.shape[1], d)}, tokens=ids
        )
    with pytest.raises(InvalidSetting, match=r"does not match the tokens"):
        write_corpus(tmp_path / "bad", {"blocks.0.hook_resid_pre": torch.zeros(1, 3, d)}, tokens=ids)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("storage_dtype", ["float16", "bfloat16"])
def test_vllm_files_across_segments_are_stored_exactly(tmp_path: Path, storage_dtype: str) -> None:
    """Windows straddling small segments (the last one shorter), layer ids out of order, stored as
    float16 or bfloat16: every stored row is the file's value cast by torch here, bit for bit, and the
    store verifies; each position's token and text are the tokenizer's string for the file's id (asked
    one id at a time here), and no prediction's top token is empty."""
    from click.testing import CliRunner

    from actstore.cli import main

    rng = np.random.default_rng(3)
    layer_ids = [2, 0, 1]
    folder = tmp_path / "hs"
    folder.mkdir()
    given, token_ids = [], []
    for k, n in enumerate([5, 11, 3, 9, 6]):
        hidden = (rng.standard_normal((n, len(layer_ids), 64)) * 10.0 ** rng.integers(-3, 4)).astype(
            np.float32
        )
        token_ids.append(rng.integers(0, 200, n).astype(np.int64))
        vllm_file(folder / f"req-{k}.safetensors", token_ids[-1], hidden)
        given.append(hidden)
    write_corpus(
        tmp_path / "s", folder, layer_ids=layer_ids, model="tiny-llama", storage_dtype=storage_dtype,
        segment_size=8, predict=False,
    )  # fmt: skip
    store = actstore.open(tmp_path / "s")
    assert store.manifest.n_segments == 5  # 34 rows, 8 a segment
    every = np.concatenate(given)
    want = torch.from_numpy(every).to(getattr(torch, storage_dtype)).float().numpy()
    got = store.select().features("resid", layers=[0, 1, 2])
    for k, i in enumerate(layer_ids):
        np.testing.assert_array_equal(got[:, i], want[:, k])
    assert CliRunner().invoke(main, ["verify", str(tmp_path / "s")]).exit_code == 0
    tokenizer = load_model("tiny-llama").tokenizer
    ids = np.concatenate(token_ids).tolist()
    strings = [str(tokenizer.convert_ids_to_tokens([i])[0]) for i in ids]
    pos = store.sql("SELECT token_id, token FROM positions ORDER BY row").to_pydict()
    assert pos == {"token_id": ids, "token": strings} and len(set(strings)) > 5
    assert store.sql("SELECT text FROM examples ORDER BY example_id").column("text").to_pylist() == strings
    assert set(store.sql("SELECT top_token FROM targets").column("top_token").to_pylist()) == {""}


def test_every_module_imports_after_nnsight() -> None:
    """nnsight 0.8 gives every object a ``save`` attribute, which a dataclass field named ``save`` with
    no default takes as its default (the command line's ``Run`` did, so importing actstore.cli after
    nnsight failed): every module of the package imports in a fresh process that imported nnsight."""
    code = (
        "import importlib, pkgutil, nnsight, actstore\n"
        "assert hasattr(object, 'save')\n"
        "for m in pkgutil.walk_packages(actstore.__path__, 'actstore.'):\n"
        "    importlib.import_module(m.name)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


def _files(folder: Path, bad: float | None = None) -> list[np.ndarray]:
    """Five vLLM-layout files of 5, 11, 3, 9 and 6 positions (residual indices 2, 0, 1); with ``bad``,
    window 3's position 6 holds it in the file's layer 1 (residual 0): row 25, segment 3 of 8 rows."""
    rng = np.random.default_rng(11)
    folder.mkdir()
    given = []
    for k, n in enumerate([5, 11, 3, 9, 6]):
        hidden = rng.standard_normal((n, 3, 64)).astype(np.float32)
        if bad is not None and k == 3:
            hidden[6, 1, 9] = bad
        vllm_file(folder / f"req-{k}.safetensors", rng.integers(0, 200, n).astype(np.int64), hidden)
        given.append(hidden)
    return given


@pytest.mark.parametrize(
    ("storage_dtype", "bad", "line"),
    [
        ("float16", -7.0e4, "window 3, residual 0: a value of magnitude 70000 is past float16's 65504"),
        ("float32", np.nan, "window 3, residual 0: not finite"),
    ],
)
def test_a_new_store_that_meets_a_bad_value_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, storage_dtype: str, bad: float, line: str
) -> None:
    """A new store reads each file once: no pass over the values before the store is touched (the
    check runs on each segment's cast rows).  A value the store cannot hold, met in segment 3 after
    segments 0-2 were committed, gives the line naming its window and residual, and the store is
    removed: a missing root is missing again, an empty folder is left empty."""
    import actstore.ingest.external as external
    from actstore.core.writer import StoreWriter

    def no_pre_pass(w: object) -> None:
        raise AssertionError("the values were read before the store was touched")

    monkeypatch.setattr(external, "_extremes", no_pre_pass)
    written: list[int] = []
    real = StoreWriter.write_segment

    def spy(self: StoreWriter, seg: int, *args: object, **kw: object) -> None:
        written.append(seg)
        real(self, seg, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(StoreWriter, "write_segment", spy)
    _files(tmp_path / "hs", bad)
    kw = dict(
        layer_ids=[2, 0, 1], model="tiny-llama", storage_dtype=storage_dtype, segment_size=8, predict=False
    )
    for out in (tmp_path / "missing", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        written.clear()
        with pytest.raises(InvalidSetting, match=line):
            write_corpus(out, tmp_path / "hs", **kw)  # type: ignore[arg-type]
        assert written == [0, 1, 2]  # committed before the bad segment was met
        assert (list(out.iterdir()) == []) if out.name == "empty" else not out.exists()
    written.clear()
    _files(tmp_path / "good")  # the same files without the bad value: every segment, the values as given
    write_corpus(tmp_path / "ok", tmp_path / "good", **kw)  # type: ignore[arg-type]
    assert written == [0, 1, 2, 3, 4]


def test_a_bad_value_costs_nothing_of_the_store_it_would_overwrite(tmp_path: Path) -> None:
    """With a store to overwrite (or resume), the values are checked before anything is deleted or
    written: the bad file is refused and the store there reads and verifies as before."""
    from click.testing import CliRunner

    from actstore.cli import main

    kw = dict(layer_ids=[2, 0, 1], model="tiny-llama", storage_dtype="float32", segment_size=8, predict=False)
    given = _files(tmp_path / "good")
    write_corpus(tmp_path / "s", tmp_path / "good", **kw)  # type: ignore[arg-type]
    _files(tmp_path / "bad", np.inf)
    with pytest.raises(InvalidSetting, match="window 3, residual 0: not finite"):
        write_corpus(tmp_path / "s", tmp_path / "bad", overwrite=True, **kw)  # type: ignore[arg-type]
    got = actstore.open(tmp_path / "s").select().features("resid", layers=[0, 1, 2])
    every = np.concatenate(given)
    for k, i in enumerate([2, 0, 1]):
        np.testing.assert_array_equal(got[:, i], every[:, k])
    assert CliRunner().invoke(main, ["verify", str(tmp_path / "s")]).exit_code == 0


def test_kept_layers_of_a_partial_chunk_of_rows_are_stored_exactly(tmp_path: Path) -> None:
    """Residuals 2 and 0 of tiny-llama's 0..2 (the writer is given those two layers only and writes
    residual 1 as zeros it never makes), 300 positions in one segment of 256-row chunks (the last one
    partial): every stored row is the file's value, the layer not kept is refused, and the store
    verifies, values included."""
    from click.testing import CliRunner

    from actstore.cli import main

    rng = np.random.default_rng(8)
    (tmp_path / "hs").mkdir()
    given = []
    for k in range(3):
        hidden = rng.standard_normal((100, 2, 64)).astype(np.float32)
        vllm_file(tmp_path / "hs" / f"r{k}.safetensors", rng.integers(0, 200, 100).astype(np.int64), hidden)
        given.append(hidden)
    write_corpus(
        tmp_path / "s", tmp_path / "hs", layer_ids=[2, 0], model="tiny-llama", storage_dtype="float32",
        segment_size=512, predict=False,
    )  # fmt: skip
    store = actstore.open(tmp_path / "s")
    assert store.manifest.n_segments == 1 and store.manifest.chunk_rows == 256
    every = np.concatenate(given)
    got = store.select().features("resid", layers=[0, 2])
    np.testing.assert_array_equal(got[:, 0], every[:, 1])
    np.testing.assert_array_equal(got[:, 1], every[:, 0])
    with pytest.raises(Exception, match="not kept|not captured|kept"):
        store.select().features("resid", layers=[1])
    r = CliRunner().invoke(main, ["verify", "--values", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
