"""An import's predictions on the test device (``ACTSTORE_TEST_DEVICE``: the CPU here, CUDA under
benchmarks/gpu.sh): the targets' top token, the next token's log-probability and rank equal those of
transformers' own final norm and head applied to the imported last residual, on the CPU, in float64."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from helpers import TEST_DEVICE

import actstore
from actstore.ingest.models.registry import load_model
from actstore.jobs.import_acts import write_corpus


def test_predictions_on_the_test_device(tmp_path: Path) -> None:
    loaded = load_model("tiny-llama")
    n_layers = loaded.model.config.num_hidden_layers
    rng = np.random.default_rng(7)
    tokens = torch.from_numpy(rng.integers(3, loaded.model.config.vocab_size, size=(3, 20)))
    cache = {f"blocks.{i}.hook_resid_pre": torch.randn(3, 20, 64) for i in range(n_layers)}
    last = torch.randn(3, 20, 64) * 3
    cache[f"blocks.{n_layers - 1}.hook_resid_post"] = last  # residual n_layers: the predictions' input
    write_corpus(tmp_path / "s", cache, tokens=tokens, model="tiny-llama", device=TEST_DEVICE)
    got = (
        actstore.open(tmp_path / "s")
        .sql("SELECT top_token_id, object_token_id, object_logprob, object_rank FROM targets ORDER BY row")
        .to_pydict()
    )

    m = loaded.model.double()  # the independent computation: transformers' modules, float64, CPU
    with torch.no_grad():
        logp = torch.log_softmax(m.lm_head(m.model.norm(last.double())), -1).reshape(60, -1)
    nxt = torch.cat([tokens[:, 1:], torch.full((3, 1), -1)], 1).reshape(-1)
    assert got["object_token_id"] == nxt.tolist()
    top2 = logp.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1] > 1e-4).numpy()  # no near-tie, where float32 may pick either
    assert clear.sum() >= 40
    np.testing.assert_array_equal(np.array(got["top_token_id"])[clear], logp.argmax(-1).numpy()[clear])
    has = nxt >= 0
    want_lp = logp[has.nonzero()[:, 0], nxt[has]].numpy()
    np.testing.assert_allclose(np.array(got["object_logprob"])[has.numpy()], want_lp, rtol=0, atol=2e-4)
    assert np.isnan(np.array(got["object_logprob"])[~has.numpy()]).all()
    # the rank: how many tokens score above the next one; a token within 1e-4 of it may fall either way
    # at float32 (the next token itself is always within: never counted)
    lp = logp[has.nonzero()[:, 0], nxt[has]][:, None]
    surely, maybe = (logp[has] > lp + 1e-4).sum(-1).numpy(), (logp[has] > lp - 1e-4).sum(-1).numpy() - 1
    rank = np.array(got["object_rank"])[has.numpy()]
    assert ((surely <= rank) & (rank <= maybe)).all() and (surely == maybe).sum() >= 30
    assert (np.array(got["object_rank"])[~has.numpy()] == -1).all()
