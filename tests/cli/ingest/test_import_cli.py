"""``actstore import``: vLLM extract_hidden_states files (the layout a test helper writes, as vLLM's
ExampleHiddenStatesConnector does) and a saved cache; bad input is one line, a non-zero exit and no store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import actstore
from actstore.cli import main

D, L = 64, 2  # tiny-llama


def vllm_files(folder: Path, n: int = 3, width: int = D, seed: int = 0) -> list[np.ndarray]:
    folder.mkdir()
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        ids = rng.integers(3, 200, size=5 + k).astype(np.int64)
        hs = rng.standard_normal((ids.size, 2, width)).astype(np.float32)
        save_file(
            {"hidden_states": torch.from_numpy(hs), "token_ids": torch.from_numpy(ids)},
            str(folder / f"r{k}.safetensors"),
        )
        out.append(hs)
    return out


def test_vllm_folder(tmp_path: Path) -> None:
    hs = vllm_files(tmp_path / "hs")
    args = [
        "import",
        str(tmp_path / "hs"),
        "--layer-ids",
        "2,0",
        "--model",
        "tiny-llama",
        "--out",
        str(tmp_path / "s"),
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    s = actstore.open(tmp_path / "s")
    assert s.manifest.n_examples == sum(h.shape[0] for h in hs)
    np.testing.assert_array_equal(s.select().features("resid", layers=[0, 2]), np.concatenate(hs)[:, ::-1])
    # the last residual was given: the predictions are the model's
    assert s.sql("SELECT min(top_token_id) AS m FROM targets").to_pylist()[0]["m"] >= 0
    assert CliRunner().invoke(main, ["verify", str(tmp_path / "s")]).exit_code == 0


def test_saved_cache(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    tokens = torch.from_numpy(rng.integers(3, 200, size=(2, 4)))
    cache = {f"blocks.{i}.hook_resid_pre": torch.randn(2, 4, D) for i in range(L)} | {"tokens": tokens}
    cache["blocks.0.attn.hook_z"] = torch.randn(2, 4, 4, 16)  # not a residual: ignored
    torch.save(cache, tmp_path / "cache.pt")
    r = CliRunner().invoke(
        main, ["import", str(tmp_path / "cache.pt"), "--model", "tiny-llama", "--out", str(tmp_path / "s")]
    )
    assert r.exit_code == 0, r.output
    got = actstore.open(tmp_path / "s").select().features("resid", layers=[0, 1])
    np.testing.assert_array_equal(got[:, 1], cache["blocks.1.hook_resid_pre"].reshape(8, D).numpy())


def test_bad_input_one_line_no_store(tmp_path: Path) -> None:
    vllm_files(tmp_path / "hs", width=D + 1)
    out = tmp_path / "s"
    r = CliRunner().invoke(
        main,
        ["import", str(tmp_path / "hs"), "--layer-ids", "0,1", "--model", "tiny-llama", "--out", str(out)],
    )
    assert r.exit_code != 0
    assert len(r.output.strip().splitlines()) == 1 and "[5, 64]" in r.output, r.output
    assert not out.exists()
    r = CliRunner().invoke(
        main, ["import", str(tmp_path / "hs"), "--layer-ids", "0", "--model", "tiny-llama", "--out", str(out)]
    )
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1 and "layers=1" in r.output, r.output
    assert not out.exists()


def test_bfloat16_and_float16_files_are_read_exactly(tmp_path: Path) -> None:
    """vLLM writes the model's dtype (often bfloat16, which numpy has no type for): each file's rows are
    read on demand in its own dtype and widened exactly into a float32 store."""
    rng = np.random.default_rng(3)
    want = []
    (tmp_path / "hs").mkdir()
    for k, dt in enumerate((torch.bfloat16, torch.float16)):
        hs = torch.from_numpy(rng.standard_normal((4 + k, 2, D)).astype(np.float32)).to(dt)
        ids = torch.from_numpy(rng.integers(3, 200, size=4 + k))
        save_file({"hidden_states": hs, "token_ids": ids}, str(tmp_path / "hs" / f"r{k}.safetensors"))
        want.append(hs.float().numpy())
    r = CliRunner().invoke(
        main,
        [
            "import",
            str(tmp_path / "hs"),
            "--layer-ids",
            "0,2",
            "--model",
            "tiny-llama",
            "--out",
            str(tmp_path / "s"),
        ],
    )
    assert r.exit_code == 0, r.output
    got = actstore.open(tmp_path / "s").select().features("resid", layers=[0, 2])
    np.testing.assert_array_equal(got, np.concatenate(want))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "r0.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    r = CliRunner().invoke(
        main,
        [
            "import",
            str(tmp_path / "bad"),
            "--layer-ids",
            "0",
            "--model",
            "tiny-llama",
            "--out",
            str(tmp_path / "b"),
        ],
    )
    assert (
        r.exit_code != 0 and len(r.output.strip().splitlines()) == 1 and "not a safetensors file" in r.output
    )
    assert not (tmp_path / "b").exists()


def test_a_value_past_float16_is_refused_for_a_float16_store(tmp_path: Path) -> None:
    """A float16 store would hold it as infinity: one line naming --dtype float32, no store; float32 takes it."""
    hs = vllm_files(tmp_path / "hs", n=1)[0]
    hs[2, 1, 5] = -7.0e4  # past float16's 65504
    save_file(
        {"hidden_states": torch.from_numpy(hs), "token_ids": torch.arange(3, 3 + hs.shape[0])},
        str(tmp_path / "hs" / "r0.safetensors"),
    )
    base = ["import", str(tmp_path / "hs"), "--layer-ids", "0,1", "--model", "tiny-llama"]
    r = CliRunner().invoke(main, [*base, "--dtype", "float16", "--out", str(tmp_path / "s16")])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "70000" in r.output and "--dtype float32" in r.output and not (tmp_path / "s16").exists()
    r = CliRunner().invoke(main, [*base, "--out", str(tmp_path / "s32")])
    assert r.exit_code == 0, r.output
    got = actstore.open(tmp_path / "s32").select().features("resid", layers=[1])[:, 0]
    np.testing.assert_array_equal(got, hs[:, 1])


def test_a_bad_value_is_named_by_its_window_and_residual(tmp_path: Path) -> None:
    """The values check reads each file once for all its layers: the line still names the window and the
    residual index the file's layer maps to (--layer-ids 2,0: the file's layer 0 is residual 2)."""
    hs = vllm_files(tmp_path / "hs", n=3)

    def rewrite() -> None:
        for k, h in enumerate(hs):
            ids = torch.arange(3, 3 + h.shape[0])
            save_file(
                {"hidden_states": torch.from_numpy(h), "token_ids": ids},
                str(tmp_path / "hs" / f"r{k}.safetensors"),
            )

    hs[1][3, 0, 7] = np.nan  # window 1, the file's layer 0: residual 2
    hs[2][1, 1, 2] = 9.0e4  # window 2, the file's layer 1: residual 0, past float16
    rewrite()
    base = ["import", str(tmp_path / "hs"), "--layer-ids", "2,0", "--model", "tiny-llama"]
    r = CliRunner().invoke(main, [*base, "--out", str(tmp_path / "a")])
    assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1, r.output
    assert "window 1, residual 2: not finite" in r.output and not (tmp_path / "a").exists()
    hs[1][3, 0, 7] = 0.5
    rewrite()
    r = CliRunner().invoke(main, [*base, "--dtype", "float16", "--out", str(tmp_path / "b")])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "window 2, residual 0: a value of magnitude 90000" in r.output and not (tmp_path / "b").exists()
    r = CliRunner().invoke(main, [*base, "--out", str(tmp_path / "c")])  # float32 takes it
    assert r.exit_code == 0, r.output
    got = actstore.open(tmp_path / "c").select().features("resid", layers=[0, 2])
    np.testing.assert_array_equal(got[:, 0], np.concatenate([h[:, 1] for h in hs]))
    np.testing.assert_array_equal(got[:, 1], np.concatenate([h[:, 0] for h in hs]))


def test_the_documented_example_runs(tmp_path: Path) -> None:
    """docs/commands.md's example of ``actstore import`` (SmolLM2-135M, three layer ids), run as written
    on files in vLLM's layout written by the helper above, its /tmp/ paths under a temporary folder."""
    import shlex

    doc = (Path(__file__).resolve().parents[3] / "docs" / "commands.md").read_text()
    section = doc.split("## actstore import\n", 1)[1].split("\n## ", 1)[0]
    example = section.split("Example:\n", 1)[1].strip().splitlines()[0].strip()
    argv = shlex.split(example.replace("/tmp/", f"{tmp_path}/"))
    assert argv[:2] == ["actstore", "import"]
    layer_ids = [int(x) for x in argv[argv.index("--layer-ids") + 1].split(",")]
    folder = Path(argv[2])
    rng = np.random.default_rng(5)
    folder.mkdir()
    for k in range(2):
        ids = torch.from_numpy(rng.integers(3, 1000, size=6))
        hs = torch.from_numpy(rng.standard_normal((6, len(layer_ids), 576)).astype(np.float32))
        save_file({"hidden_states": hs, "token_ids": ids}, str(folder / f"r{k}.safetensors"))
    r = CliRunner().invoke(main, argv[1:])
    assert r.exit_code == 0, r.output
    out = Path(argv[argv.index("--out") + 1])
    s = actstore.open(out)
    assert s.manifest.n_examples == 12 and s.geometry.d_model == 576
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0


def test_no_predict(tmp_path: Path) -> None:
    """``--no-predict``: the last residual is stored, and no prediction is made from it (-1 / NaN)."""
    hs = vllm_files(tmp_path / "hs")
    base = ["import", str(tmp_path / "hs"), "--layer-ids", "2,0", "--model", "tiny-llama"]
    r = CliRunner().invoke(main, [*base, "--no-predict", "--out", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    s = actstore.open(tmp_path / "s")
    got = s.sql("SELECT top_token_id AS t, object_logprob AS lp, object_rank AS r FROM targets").to_pylist()
    assert len(got) == sum(h.shape[0] for h in hs)
    assert all(row["t"] == -1 and row["lp"] != row["lp"] and row["r"] == -1 for row in got)  # NaN != NaN
    np.testing.assert_array_equal(s.select().features("resid", layers=[2])[:, 0], np.concatenate(hs)[:, 0])


def test_a_device_torch_cannot_use_is_one_line_and_no_store(tmp_path: Path) -> None:
    """``--device`` names where the model computes the predictions; one torch cannot reach (a CUDA device
    on a machine or build without one, a name torch does not know) is one line and no store."""
    vllm_files(tmp_path / "hs")
    base = ["import", str(tmp_path / "hs"), "--layer-ids", "2,0", "--model", "tiny-llama"]
    bad = ["nonsense"] + ([] if torch.cuda.is_available() else ["cuda"])
    for k, device in enumerate(bad):
        r = CliRunner().invoke(main, [*base, "--device", device, "--out", str(tmp_path / f"s{k}")])
        assert r.exit_code != 0 and len(r.output.strip().splitlines()) == 1, r.output
        assert r.output.startswith("error: ") and device in r.output and not (tmp_path / f"s{k}").exists()
    r = CliRunner().invoke(main, [*base, "--device", "cpu", "--out", str(tmp_path / "cpu")])
    assert r.exit_code == 0, r.output
