"""Check actstore's tuned lens (query/analyses/tuned_lens.py) against the ``tuned-lens`` package.

The package is not a dependency of actstore: install it into a separate virtual environment,

    python3 -m venv /tmp/tl-venv
    /tmp/tl-venv/bin/pip install torch==2.13.0 tuned-lens
    # tuned-lens 0.2.0 (2023) imports torchdata.dataloader2 and passes load_in_8bit to from_pretrained:
    /tmp/tl-venv/bin/pip install --no-deps torchdata==0.9.0
    /tmp/tl-venv/bin/pip install transformers==4.44.2 datasets==3.6.0

then, from the repository root with actstore's environment:

    .venv/bin/python benchmarks/tuned_lens_check.py --tl-python /tmp/tl-venv/bin/python

What it does (nothing is downloaded):

1. builds a random GPT-2 from a config (4 layers, d_model 64, vocabulary 512, seed 0, initializer
   range 0.2 so that its output distributions are not flat) and a word-level tokenizer of 510
   pseudo-words, saves both to ``--workdir``; writes a JSONL corpus of identical documents of
   ``T - 1`` words drawn with Zipf-like frequencies, so that the package's GPT-style chunking (an end-of-text token, then the document)
   makes every chunk the same ``T`` tokens: with ``--tokens_per_step T`` each of the package's
   steps then sees exactly the data that actstore's full-batch step sees, whatever the shuffling;
2. runs the package's own ``tuned-lens train`` (its ``main``, in the other environment) for Adam
   and for Nesterov SGD with the package's optimiser settings (``--warmup_steps 0``, which 0.2.0
   uses for Adam anyway), twice each: as shipped (the lens forward under bfloat16 autocast) and
   with ``torch.autocast`` replaced by a no-op (float32), and dumps the chunk it trained on;
3. runs the same model on that chunk here with Hugging Face's ``output_hidden_states`` and takes the
   residual stream at every position (the embeddings, each block's output, and the input of the
   final LayerNorm): the reference states;
4. writes the chunk as a one-document text corpus (the literal ``</s>`` then the words) and ingests it
   with actstore's own corpus path, ``actstore ingest --positions all --kinds resid --keep-special
   --dtype float32 --model WORKDIR/model --dataset text:WORKDIR/chunk.txt``; checks that the
   ``positions`` table's token ids are the chunk's ``T`` tokens, that the residuals read back from
   the store (``corpus_residuals``, i.e. ``Selection.features("resid")`` over the table's rows) equal
   the reference states, and that the store's final readout reproduces the model's logits;
5. trains actstore's translators with the package's settings (full batch, 250 steps) twice: on the
   store's residuals through the store's readout (the path ``actstore corpus-lens`` takes) and, as
   before, on the Hugging Face states;
6. reports per translator the relative Frobenius difference of the weights and biases and the KL
   divergence to the model's output reached by each lens on the chunk (the store's states).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OPTIMIZERS = ("adam", "sgd")
PRECISIONS = ("bf16", "fp32")


# ------------------------------------------------------------------------------------ preparation (actstore env)


def prepare(work: Path, tokens: int, steps: int, seed: int, vocab: int = 512) -> None:
    """Random GPT-2, a word-level tokenizer of ``vocab`` pseudo-words and a corpus of identical documents."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab - 2)]
    backend = Tokenizer(
        models.WordLevel({"<unk>": 0, "</s>": 1} | {w: i + 2 for i, w in enumerate(words)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", unk_token="<unk>", model_max_length=tokens
    )
    tok.save_pretrained(work / "model")
    conf = work / "model" / "tokenizer_config.json"  # loadable by the older transformers next to tuned-lens
    conf.write_text(json.dumps(json.loads(conf.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"}))
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=tokens,
        n_embd=64,
        n_layer=4,
        n_head=4,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(cfg).eval().save_pretrained(work / "model")
    # one document of tokens - 1 words (Zipf-like frequencies), so that "</s>" + document = one chunk
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, len(words) + 1)
    text = " ".join(rng.choice(words, size=tokens - 1, p=p / p.sum()))
    assert len(tok(tok.eos_token + text)["input_ids"]) == tokens
    with open(work / "corpus.jsonl", "w") as f:
        for _ in range(steps + 1):  # the package drops the last chunk of each map batch
            f.write(json.dumps({"text": text}) + "\n")


# ------------------------------------------------------------------------------------ the package (tl env)


def run_package(work: Path, tokens: int, steps: int, optimizer: str, precision: str) -> None:
    import contextlib

    import torch
    from transformers import AutoTokenizer
    from tuned_lens.__main__ import main
    from tuned_lens.scripts.ingredients import Data

    class NoAutocast(contextlib.ContextDecorator):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> NoAutocast:
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

    if precision == "fp32":  # the package wraps its lens forward in bfloat16 autocast: disable it
        torch.autocast = NoAutocast  # type: ignore[misc,assignment]

    out = work / f"package-{optimizer}-{precision}"
    if precision == "fp32" and optimizer == "adam":  # dump the chunks once
        tok = AutoTokenizer.from_pretrained(work / "model")
        data, _ = Data(name=[str(work / "corpus.jsonl")], max_length=tokens).load(tok)
        ids = data["input_ids"]
        first = ids[0].tolist()
        if len(ids) < steps or any(x.tolist() != first for x in ids):
            raise SystemExit(f"chunking did not give {steps} identical chunks ({len(ids)} chunks)")
        (work / "chunk.json").write_text(json.dumps(first))
    main(
        [
            "train",
            "--model.name",
            str(work / "model"),
            "--data.name",
            str(work / "corpus.jsonl"),
            "--max_length",
            str(tokens),
            "--tokens_per_step",
            str(tokens),
            "--per_gpu_batch_size",
            "1",
            "--num_steps",
            str(steps),
            "--optimizer",
            optimizer.upper(),
            "--warmup_steps",
            "0",
            "--loss",
            "KL",
            "--output",
            str(out),
        ]
    )


# ------------------------------------------------------------------------------------ comparison (actstore env)


def ingest_chunk(work: Path, chunk: list[int]) -> Path:
    """The chunk as a one-document text corpus, ingested by actstore's CLI at every position; the store."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(work / "model")
    words = " ".join(tok.convert_ids_to_tokens(chunk[1:]))
    doc = f"{tok.eos_token} {words}"  # the literal end-of-text token, kept by --keep-special
    if chunk[0] != tok.eos_token_id or tok(doc, add_special_tokens=False)["input_ids"] != chunk:
        raise SystemExit("the chunk is not the end-of-text token followed by the document's words")
    (work / "chunk.txt").write_text(doc + "\n")
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    cmd = [
        str(Path(sys.executable).with_name("actstore")),
        "ingest",
        "--positions",
        "all",
        "--kinds",
        "resid",
        "--keep-special",
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--model",
        str(work / "model"),
        "--dataset",
        f"text:{work / 'chunk.txt'}",
        "--out",
        str(store),
        "--quiet",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"actstore ingest failed:\n{res.stderr[-3000:]}")
    return store


def compare(work: Path, steps: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from transformers import GPT2LMHeadModel

    sys.path.insert(0, str(REPO))
    from actstore import open_store
    from actstore.query.analyses.corpus_lens import check_corpus_residuals, corpus_residuals
    from actstore.query.analyses.lens import FinalReadout, TunedLens
    from actstore.query.analyses.tuned_lens import TrainConfig, kl_per_index, train_tuned_lens

    torch.set_num_threads(1)
    model = GPT2LMHeadModel.from_pretrained(work / "model").eval()
    chunk = json.loads((work / "chunk.json").read_text())
    ids = torch.tensor([chunk])
    captured: dict[str, torch.Tensor] = {}
    ln_f = model.transformer.ln_f
    hook = ln_f.register_forward_pre_hook(lambda m, args: captured.__setitem__("last", args[0].detach()))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    hook.remove()
    L = model.config.n_layer
    states = [out.hidden_states[i][0] for i in range(L)] + [captured["last"][0]]  # pre-norm, indices 0..L
    resid = torch.stack(states, dim=1)  # [T, L+1, d]
    readout = FinalReadout(
        "layernorm",
        float(ln_f.eps),
        ln_f.weight.detach(),
        ln_f.bias.detach(),
        model.lm_head.weight.detach(),
        None,
        None,
    )
    err = float((readout.logits(resid[:, L]) - out.logits[0]).abs().max())
    assert err < 1e-3, f"the readout does not reproduce the model's logits ({err})"

    # actstore's corpus path: the chunk ingested at every position, read back from the store
    store = open_store(ingest_chunk(work, chunk))
    assert check_corpus_residuals(store) == L + 1
    pos = store.sql("SELECT example_id, document, position, token_id FROM positions ORDER BY example_id")
    rows = pos.column("example_id").to_numpy()
    assert pos.column("token_id").to_pylist() == chunk, "the positions table does not hold the chunk's tokens"
    assert pos.column("position").to_pylist() == list(range(len(chunk)))
    assert set(pos.column("document").to_pylist()) == {0}
    stored = torch.from_numpy(np.ascontiguousarray(corpus_residuals(store, rows)))  # [T, L+1, d]
    assert stored.dtype == torch.float32 and stored.shape == resid.shape, (stored.dtype, stored.shape)
    store_err = float((stored - resid).abs().max())
    assert store_err <= 1e-5 * float(resid.abs().max()), f"stored residuals differ from HF's ({store_err})"
    store_readout = FinalReadout.from_store(store)
    store_logit_err = float((store_readout.logits(stored[:, L]) - out.logits[0]).abs().max())
    assert store_logit_err < 1e-3, f"the store's readout does not reproduce the logits ({store_logit_err})"

    result: dict[str, Any] = {
        "tokens": int(resid.shape[0]),
        "layers": L,
        "d_model": int(resid.shape[2]),
        "vocab": int(readout.unembed.shape[0]),
        "steps": steps,
        "readout_max_abs_err": err,
        "store_rows": len(rows),
        "store_resid_max_abs_diff": store_err,
        "store_resid_identical": bool(torch.equal(stored, resid)),
        "store_readout_max_abs_err": store_logit_err,
        "kl_logit_lens": kl_per_index(store_readout, stored).tolist()[:L],
        "kl_logit_lens_hf": kl_per_index(readout, resid).tolist()[:L],
        "runs": {},
    }
    for opt in OPTIMIZERS:
        ours = train_tuned_lens(store_readout, stored, TrainConfig(optimizer=opt, steps=steps))
        ours_hf = train_tuned_lens(readout, resid, TrainConfig(optimizer=opt, steps=steps))
        row: dict[str, Any] = {
            "kl_actstore": kl_per_index(store_readout, stored, ours)[:L].tolist(),
            "kl_actstore_hf": kl_per_index(readout, resid, ours_hf)[:L].tolist(),
            "rel_diff_weight_store_vs_hf": [
                float((ours.D[i] - ours_hf.D[i]).norm() / ours_hf.D[i].norm()) for i in range(L)
            ],
        }
        for prec in PRECISIONS:
            state = torch.load(work / f"package-{opt}-{prec}" / "params.pt", map_location="cpu")
            D = torch.stack([state[f"{i}.weight"].float().T for i in range(L)])
            b = torch.stack([state[f"{i}.bias"].float() for i in range(L)])
            pkg = TunedLens(D, b, method=f"package-{opt}")
            row[prec] = {
                "kl_package": kl_per_index(store_readout, stored, pkg)[:L].tolist(),
                "rel_diff_weight": [float((ours.D[i] - D[i]).norm() / D[i].norm()) for i in range(L)],
                "rel_diff_bias": [float((ours.b[i] - b[i]).norm() / b[i].norm()) for i in range(L)],
                "rel_diff_weight_hf": [float((ours_hf.D[i] - D[i]).norm() / D[i].norm()) for i in range(L)],
                "rel_diff_bias_hf": [float((ours_hf.b[i] - b[i]).norm() / b[i].norm()) for i in range(L)],
                "weight_norm_package": [float(D[i].norm()) for i in range(L)],
            }
        result["runs"][opt] = row
    return result


def report(r: dict[str, Any]) -> str:
    lines = [
        f"random GPT-2: {r['layers']} layers, d_model {r['d_model']}, vocabulary {r['vocab']}, "
        f"{r['tokens']} positions, {r['steps']} steps (readout max |error| {r['readout_max_abs_err']:.1e})",
        f"store: {r['store_rows']} rows, token ids = the chunk's; stored resid vs HF hidden states: max |diff| "
        f"{r['store_resid_max_abs_diff']:.1e} (identical: {r['store_resid_identical']}); store readout max "
        f"|error| {r['store_readout_max_abs_err']:.1e}",
        "ours: trained on the store's residuals; KL read on them. Differences to the package (weights, biases).",
        "optimizer  index  KL logit  KL ours(store)  KL ours(HF)  KL pkg fp32  KL pkg bf16  |dW|/|W| fp32  "
        "|db|/|b| fp32  |dW|/|W| bf16  |db|/|b| bf16  |dW| store vs HF",
    ]
    for opt, row in r["runs"].items():
        for i in range(r["layers"]):
            f, h = row["fp32"], row["bf16"]
            lines.append(
                f"{opt:<9}  {i:>5}  {r['kl_logit_lens'][i]:8.4f}  {row['kl_actstore'][i]:14.5f}  "
                f"{row['kl_actstore_hf'][i]:11.5f}  "
                f"{f['kl_package'][i]:11.5f}  {h['kl_package'][i]:11.5f}  {f['rel_diff_weight'][i]:13.1e}  "
                f"{f['rel_diff_bias'][i]:13.1e}  {h['rel_diff_weight'][i]:13.1e}  {h['rel_diff_bias'][i]:13.1e}  "
                f"{row['rel_diff_weight_store_vs_hf'][i]:17.1e}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", nargs="?", default="all", choices=["all", "_package"])
    ap.add_argument(
        "--tl-python", default="/tmp/tl-venv/bin/python", help="Python of the environment with tuned-lens."
    )
    ap.add_argument("--workdir", default="/tmp/tuned-lens-check")
    ap.add_argument("--tokens", type=int, default=1024, help="Positions per step (one chunk).")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32")
    ap.add_argument("--json", dest="json_out", default=None, help="Write the result as JSON here.")
    a = ap.parse_args()
    work = Path(a.workdir)
    if a.stage == "_package":
        run_package(work, a.tokens, a.steps, a.optimizer, a.precision)
        return
    work.mkdir(parents=True, exist_ok=True)
    prepare(work, a.tokens, a.steps, a.seed)
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "HF_DATASETS_CACHE": str(work / "hf-datasets"),
    }
    for opt in OPTIMIZERS:
        for prec in ("fp32", "bf16"):
            cmd = [
                a.tl_python,
                str(Path(__file__).resolve()),
                "_package",
                "--workdir",
                str(work),
                "--tokens",
                str(a.tokens),
                "--steps",
                str(a.steps),
                "--optimizer",
                opt,
                "--precision",
                prec,
            ]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"tuned-lens train failed ({opt}, {prec}):\n{res.stderr[-3000:]}")
    result = compare(work, a.steps)
    print(report(result))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
