"""A neuron's input weights as a residual direction (``neuron:LAYER:INDEX:in|up``, ours): the row of the
MLP's input projection folded with the norm the MLP reads through.  Checked with hooks on each tiny
architecture: the projection's output for that neuron is ``u . x / scale(x)`` plus one constant over
every token, where ``x`` is what enters the norm and ``scale`` its RMS (or standard deviation).  Then
``actstore dfa`` with that spec equals ``dfa`` of the same vector saved as a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import actstore
from actstore.cli import main
from actstore.ingest.capture.architectures import architecture_for
from actstore.ingest.models.tiny import TINY_ARCHS, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = ["The capital of France is Paris, and Rome is the capital of Italy.", "hello world, once more"]


def _scale(x: np.ndarray, norm: Any) -> np.ndarray:
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    if isinstance(norm, torch.nn.LayerNorm):
        return np.sqrt(x.var(-1) + eps)
    return np.sqrt((x.astype(np.float64) ** 2).mean(-1) + eps)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_the_folded_row_gives_the_neurons_preactivation(arch: str) -> None:
    loaded = tiny_model(arch)
    model, a = loaded.model, architecture_for(loaded.model)
    layer = 1
    sides = ["gate", "up"] if hasattr(a.blocks(model).layers[layer].mlp, "up_proj") else ["gate"]
    for which in sides:
        norm, proj = a.mlp_input(model, layer, which)
        seen: dict[str, np.ndarray] = {}  # read within the iteration that made it
        h1 = norm.register_forward_pre_hook(
            lambda m, args: seen.__setitem__("x", args[0][0].detach().double().numpy())  # noqa: B023
        )
        h2 = proj.register_forward_hook(
            lambda m, args, out: seen.__setitem__("out", out[0].detach().double().numpy())  # noqa: B023
        )
        try:
            ids = loaded.tokenizer(TEXT[0], return_tensors="pt").input_ids
            with torch.no_grad():
                model(ids)
        finally:
            h1.remove()
            h2.remove()
        x, out = seen["x"], seen["out"]
        for index in (0, 3, out.shape[-1] - 1):
            u = a.neuron_input(model, layer, index, which).astype(np.float64)
            linear = x @ u / _scale(x, norm)
            rest = out[:, index] - linear
            assert np.ptp(linear) > 1e-3  # the direction carries the token-to-token variation ...
            assert np.ptp(rest) < 1e-4 * max(
                1.0, np.abs(out[:, index]).max()
            )  # ... and only a constant is left


def test_dfa_reads_a_neurons_input_weights_from_the_stores_model(tmp_path: Path) -> None:
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(TEXT) + "\n", encoding="utf-8")
    actstore.ingest_corpus(
        tmp_path / "s",
        model="tiny-llama",
        dataset=f"text:{docs}",
        positions="all",
        storage_dtype="float32",
        batch_size=2,
        segment_size=8,
        context_length=9,
        sources="3",
    )
    loaded = tiny_model("llama")
    u = architecture_for(loaded.model).neuron_input(loaded.model, 1, 5, "up")
    np.save(tmp_path / "u.npy", u)

    def dfa(direction: str) -> dict[str, Any]:
        r = CliRunner().invoke(
            main, ["dfa", str(tmp_path / "s"), "--direction", direction, "--k", "5", "--no-save", "--json"]
        )
        assert r.exit_code == 0, r.output
        out: dict[str, Any] = json.loads(r.stdout)
        return out

    assert dfa("neuron:1:5:up")["terms"] == dfa(str(tmp_path / "u.npy"))["terms"]
    r = CliRunner().invoke(
        main, ["dfa", str(tmp_path / "s"), "--direction", "neuron:1:99999:in", "--no-save"]
    )
    assert r.exit_code != 0 and "out of range" in r.output and len(r.output.strip().splitlines()) == 1
