"""Training steps/s of the field's tools fed by a store vs an in-memory tensor of the same rows and
batches, and the SAELens-cache export's rate vs a raw read of the same chunks, in one run.

    python benchmarks/bench_training_feed.py --docs 600 --context 64 --steps 200

A corpus store of a tiny Llama (d_model 64, float16) is ingested packed (whole windows of
``--context``); dictionary_learning's trainSAE and SAELens's SAETrainer then train ``--steps`` steps
of ``--batch`` rows from ``Selection.loader(epochs=None, flatten=True)`` and from a list of the same
batches already in memory (the ratio is loader/in-memory), and likewise from the export read back
(``to_hf_dataset(context_size=...)``'s Arrow file, its values memory-mapped, ``--batch // --context``
windows a batch) against its batches in memory; the export
(``to_hf_dataset(context_size=...)``) is timed in positions/s against ``Selection.features`` of the same
rows (the raw chunk read)."""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import actstore
from actstore.ingest.models.tiny import tiny_model

WORDS = "the quiet river runs past an old stone bridge a red house stands on the hill near lake".split()


def quiet() -> Any:
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=600)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    t = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        m = tiny_model("llama")
        m.model.save_pretrained(t / "model")
        m.tokenizer.save_pretrained(t / "model")
        g = torch.Generator().manual_seed(0)
        docs = [
            " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (30,), generator=g))
            for _ in range(a.docs)
        ]
        (t / "docs.txt").write_text("\n".join(docs) + "\n")
        with quiet():
            store = actstore.ingest_corpus(
                t / "c",
                model=str(t / "model"),
                dataset=f"text:{t / 'docs.txt'}",
                positions="all",
                kinds=("resid",),
                pack=True,
                keep_special=True,
                context_length=a.context,
                batch_size=16,
            )
        sel = store.select()
        n = len(sel)
        d = store.geometry.d_model
        print(f"store: {n} positions, d_model {d}, float16; steps {a.steps} x batch {a.batch}")

        def feed() -> Any:
            return sel.loader("resid", layers=[1], batch_size=a.batch, epochs=None, flatten=True, seed=0)

        # the same rows and batches, in memory (SAETrainer counts samples: an epoch's last batch is short,
        # so it takes one batch more per epoch boundary)
        extra = a.steps + a.steps * a.batch // n + 2
        f = feed()
        mem = [x for _, x in zip(range(extra), f)]
        with quiet():
            ds = sel.to_hf_dataset(t / "hf-feed", "resid", layers=[1], context_size=a.context)
        col = next(c for c in ds.column_names if c != "token_ids")
        per = max(1, a.batch // a.context)  # windows a batch

        def export_feed() -> Any:
            # the column's values, memory-mapped from the export's Arrow file (no copy): [windows * n, d]
            values = ds.data.column(col).combine_chunks().storage.flatten().flatten().to_numpy()
            x = values.reshape(-1, d)
            while True:
                for k in range(0, x.shape[0] - per * a.context + 1, per * a.context):
                    yield torch.from_numpy(x[k : k + per * a.context]).float()

        mem_export = [x for _, x in zip(range(extra), export_feed())]

        from dictionary_learning import AutoEncoder
        from dictionary_learning.trainers import StandardTrainer
        from dictionary_learning.training import trainSAE

        def dl(data: Any) -> None:
            cfg = dict(
                trainer=StandardTrainer,
                dict_class=AutoEncoder,
                activation_dim=d,
                dict_size=4 * d,
                lr=1e-3,
                device="cpu",
                steps=a.steps,
                layer=1,
                lm_name="m",
                warmup_steps=10,
                sparsity_warmup_steps=10,
            )
            with quiet():
                trainSAE(data=data, trainer_configs=[cfg], steps=a.steps, device="cpu")

        from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
        from sae_lens.config import SAETrainerConfig

        def sl(data: Any) -> None:
            sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=d, d_sae=4 * d))
            cfg = SAETrainerConfig(
                total_training_samples=a.steps * a.batch, train_batch_size_samples=a.batch, lr_end=3e-4
            )
            with quiet():
                SAETrainer(cfg, sae, data_provider=data).fit()

        rows: dict[str, list[float]] = {
            k: []
            for k in (
                *("dl_loader", "dl_mem", "sl_loader", "sl_mem"),
                *("dl_export", "dl_export_mem", "sl_export", "sl_export_mem", "export", "raw"),
            )
        }
        for _ in range(a.rounds):  # interleaved: load drifts on a shared machine
            rows["dl_loader"].append(a.steps / timed(lambda: dl(feed())))
            rows["dl_mem"].append(a.steps / timed(lambda: dl(iter(mem))))
            rows["sl_loader"].append(a.steps / timed(lambda: sl(feed())))
            rows["sl_mem"].append(a.steps / timed(lambda: sl(iter(mem))))
            rows["dl_export"].append(a.steps / timed(lambda: dl(export_feed())))
            rows["dl_export_mem"].append(a.steps / timed(lambda: dl(iter(mem_export))))
            rows["sl_export"].append(a.steps / timed(lambda: sl(export_feed())))
            rows["sl_export_mem"].append(a.steps / timed(lambda: sl(iter(mem_export))))
            out = t / "hf"
            shutil.rmtree(out, ignore_errors=True)
            with quiet():
                rows["export"].append(
                    n
                    / timed(
                        lambda out=out: sel.to_hf_dataset(out, "resid", layers=[1], context_size=a.context)
                    )
                )
            rows["raw"].append(n / timed(lambda: sel.features("resid", layers=[1])))
        med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
        print(
            f"trainSAE steps/s: loader {med['dl_loader']:.1f}, in memory {med['dl_mem']:.1f}: "
            f"{med['dl_loader'] / med['dl_mem']:.3f}x"
        )
        print(
            f"SAETrainer steps/s: loader {med['sl_loader']:.1f}, in memory {med['sl_mem']:.1f}: "
            f"{med['sl_loader'] / med['sl_mem']:.3f}x"
        )
        for tool, key in (("trainSAE", "dl"), ("SAETrainer", "sl")):
            got, ref = med[f"{key}_export"], med[f"{key}_export_mem"]
            print(f"{tool} steps/s from the export: {got:.1f}, in memory {ref:.1f}: {got / ref:.3f}x")
        print(
            f"export positions/s {med['export']:.0f} vs raw read {med['raw']:.0f}: {med['export'] / med['raw']:.1%}"
        )
    finally:
        shutil.rmtree(t, ignore_errors=True)


if __name__ == "__main__":
    main()
