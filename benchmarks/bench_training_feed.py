"""Training steps/s of the field's tools fed by a store vs an in-memory tensor of the same rows and
batches, and the SAELens-cache export's rate vs a raw read of the same chunks, in one run.

    python benchmarks/bench_training_feed.py --docs 400 --context 64 --steps 150,1000 --batch 256 \
        --export-docs 1250 --export-sizes 10000,32000,100000

A corpus store of a tiny Llama (d_model 64, float16) is ingested packed (whole windows of
``--context``); dictionary_learning's trainSAE and SAELens's SAETrainer then train each of ``--steps``
steps of ``--batch`` rows from ``Selection.loader(epochs=None, flatten=True)`` and from a list of the
same batches already in memory (the ratio is loader/in-memory).  Each tool runs in a process of its
own, as a researcher runs it: one tool's imports do not reach the other's arms (dictionary_learning
imports nnsight, which mounts ``.save`` on every Python object).  Each run gives three rates: the whole run (from the loader's construction to the
tool's return: the read of the first shuffle window included), the steady state (from the first batch
handed out to the return, as a training log's steps/s reports it) and the whole run per CPU-second of
the process (every thread's, the loader's own included: steadier than wall time on a shared machine);
the report gives medians of ``--rounds`` and the best round of each arm (the run least disturbed by
other processes); both arms' data pass through the same wrapper.  At the first ``--steps`` the tools
also train from the export read back (``to_hf_dataset(context_size=...)``'s Arrow file, its values
memory-mapped, ``--batch // --context`` windows a batch) against its batches in memory.  The export
(``to_hf_dataset(context_size=...)``) is timed in positions/s (and CPU seconds) against
``Selection.features`` of the same rows (the raw chunk read) at each of ``--export-sizes`` positions
(the first rows of the store, whole windows; with ``--export-docs`` a second store of that many
documents is ingested for them, or ``--export-store`` names one made before, e.g. by an earlier run's
ingest), so that its fixed costs show as such.  ``--only export`` times the export alone (no training store, no tools):

    python benchmarks/bench_training_feed.py --context 64 --rounds 7 --export-docs 12500 \
        --export-sizes 10000,100000,1000000 --only export

``--keep-store DIR`` keeps the export store ingested there (for ``--export-store DIR`` next time)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
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


class Clocked:
    """A tool's data, wrapped alike in both arms: when its first batch was handed out."""

    def __init__(self, data: Any) -> None:
        self.it = iter(data)
        self.first = 0.0

    def __iter__(self) -> Clocked:
        return self

    def __next__(self) -> Any:
        x = next(self.it)
        if not self.first:
            self.first = time.perf_counter()
        return x


def run(train: Any, make: Any, steps: int) -> tuple[float, float, float, float]:
    """(whole-run steps/s, steady steps/s, seconds to the first batch, whole-run steps per CPU-second of
    the process: every thread's, the loader's own included) of ``train(data)`` for ``steps`` steps,
    ``make()`` (the feed's construction) timed with it."""
    c0, t0 = time.process_time(), time.perf_counter()
    data = Clocked(make())
    train(data, steps)
    t1, c1 = time.perf_counter(), time.process_time()
    return steps / (t1 - t0), (steps - 1) / (t1 - data.first), data.first - t0, steps / (c1 - c0)


def med(v: list[float]) -> float:
    return sorted(v)[len(v) // 2]


def ingest(t: Path, name: str, docs: int, context: int, where: Path | None = None) -> Any:
    """A packed corpus store of ``docs`` documents of the tiny Llama saved in ``t / "model"``, at
    ``where`` (default ``t / name``)."""
    g = torch.Generator().manual_seed(0)
    text = [
        " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (30,), generator=g)) for _ in range(docs)
    ]
    (t / f"{name}.txt").write_text("\n".join(text) + "\n")
    with quiet():
        return actstore.ingest_corpus(
            where or t / name,
            model=str(t / "model"),
            dataset=f"text:{t / f'{name}.txt'}",
            positions="all",
            kinds=("resid",),
            pack=True,
            keep_special=True,
            context_length=context,
            batch_size=16,
        )


def load_export(path: str) -> Any:
    """``to_hf_dataset`` of another copy of query/select/hf_export.py (e.g. a git worktree of the code
    before), imported under its own name, so that both are timed in one run on the same rows."""
    spec = importlib.util.spec_from_file_location("hf_export_before", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.to_hf_dataset


LABELS = {"export": "export", "before": "export before", "plain": "read, then a plain write"}


def _read_and_write(sub: Any, out: Path) -> None:
    out.mkdir()
    sub.features("resid", layers=[1]).tofile(out / "values.bin")


class Exports:
    """The export timed against the raw read of the same rows (and a second export, ``before``, when
    given), each of ``sizes`` positions, one round at a time, the arms in alternating order."""

    def __init__(self, big: Any, sizes: list[int], context: int, t: Path, before: Any) -> None:
        self.subsets = {k: big.limit(k) for k in sizes}
        self.context, self.t = context, t
        self.rates: dict[tuple[str, int], list[float]] = {}
        self.cpu: dict[tuple[str, int], list[float]] = {}  # CPU seconds a call
        self.kw: dict[str, Any] = dict(kind="resid", layers=[1], context_size=context)
        self.arms: dict[str, Any] = {"export": lambda sub, out: sub.to_hf_dataset(out, **self.kw)}
        if before is not None:
            self.arms["before"] = lambda sub, out: before(sub, out, **self.kw)
        # the same read, then its values written to one file as they are (no Arrow, no token ids, no
        # metadata), one after the other: what an export that does not overlap its write with the read
        # cannot beat (the export overlaps them on a second thread where a core is free, and preallocates
        # its file)
        self.arms["plain"] = lambda sub, out: _read_and_write(sub, out)

    def round(self, rnd: int) -> None:
        for k, sub in self.subsets.items():
            for arm in list(self.arms)[:: 1 if rnd % 2 == 0 else -1]:
                out = self.t / "hf"
                shutil.rmtree(out, ignore_errors=True)
                c0 = time.process_time()
                with quiet():
                    took = timed(lambda sub=sub, out=out, arm=arm: self.arms[arm](sub, out))
                self.cpu.setdefault((arm, k), []).append(time.process_time() - c0)
                self.rates.setdefault((arm, k), []).append(k / took)
                shutil.rmtree(out, ignore_errors=True)
            c0 = time.process_time()
            took = timed(lambda sub=sub: sub.features("resid", layers=[1]))
            self.cpu.setdefault(("raw", k), []).append(time.process_time() - c0)
            self.rates.setdefault(("raw", k), []).append(k / took)

    def report(self) -> None:
        """Wall-clock rates, and beside them the process's CPU seconds (every thread's; on shared
        cores less moved by the time spent waiting for one)."""
        for k in self.subsets:
            r, rc = med(self.rates[("raw", k)]), med(self.cpu[("raw", k)])
            for arm in self.arms:
                e, ec = med(self.rates[(arm, k)]), med(self.cpu[(arm, k)])
                print(
                    f"{LABELS[arm]} of {k} positions: {e:.0f} vs raw "
                    f"read {r:.0f} positions/s: {e / r:.1%} ({k / e:.4f} vs {k / r:.4f} s); CPU "
                    f"{ec:.4f} vs {rc:.4f} s: {rc / ec:.1%}"
                )
        # the cost of the positions added from one size to the next (median seconds), which leaves
        # out what each call pays whatever its size: the streaming rate beside the whole call's
        sizes = sorted(self.subsets)
        for small, large in zip(sizes, sizes[1:]):
            secs = {
                arm: large / med(self.rates[(arm, large)]) - small / med(self.rates[(arm, small)])
                for arm in ("raw", *self.arms)
            }
            for arm in self.arms:
                print(
                    f"{LABELS[arm]} from {small} to {large} positions "
                    f"(the added positions only): {secs[arm]:.4f} vs raw read {secs['raw']:.4f} s: "
                    f"{secs['raw'] / secs[arm]:.1%}"
                )


def export_sizes(a: Any, big: Any, default: list[int]) -> list[int]:
    """``--export-sizes`` in whole windows, those the store holds (or all of its whole windows)."""
    sizes = (
        [int(v) // a.context * a.context for v in a.export_sizes.split(",")] if a.export_sizes else default
    )
    return [k for k in sizes if k <= len(big)] or [len(big) // a.context * a.context]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=600)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", default="150,1000", help="comma-separated step counts, each run side by side")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--export-docs", type=int, default=0, help="a second store of this many documents")
    ap.add_argument("--export-store", default="", help="an existing store of whole windows for the sizes")
    ap.add_argument("--export-sizes", default="", help="positions exported (default: the whole store)")
    ap.add_argument("--only", default="", choices=("", "export"), help="export: time the export alone")
    ap.add_argument("--keep-store", default="", help="ingest the --export-docs store here and keep it")
    ap.add_argument("--before", default="", help="another hf_export.py, timed beside this one")
    ap.add_argument("--tool", default="", choices=("", *TOOLS), help=argparse.SUPPRESS)
    ap.add_argument("--tool-store", default="", help=argparse.SUPPRESS)
    ap.add_argument("--tool-out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tool:
        torch.set_num_threads(1)
        tool_arms(a)
        return
    steps_list = [int(v) for v in a.steps.split(",")]
    torch.set_num_threads(1)
    t = Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        m = tiny_model("llama")
        m.model.save_pretrained(t / "model")
        m.tokenizer.save_pretrained(t / "model")
        if a.export_store:
            big = actstore.open(a.export_store).select()
        elif a.export_docs:
            keep = Path(a.keep_store) if a.keep_store else None
            big = ingest(t, "e", a.export_docs, a.context, keep).select()
        else:
            big = None
        if a.only == "export":
            if big is None:
                raise SystemExit("--only export needs --export-store or --export-docs")
            sizes = export_sizes(a, big, [])
            print(f"load average at the start: {os.getloadavg()[0]:.1f}")
            print(f"export sizes {sizes} (store of {len(big)} positions)")
            ex = Exports(big, sizes, a.context, t, load_export(a.before) if a.before else None)
            for rnd in range(a.rounds):
                ex.round(rnd)
            print(f"load average at the end: {os.getloadavg()[0]:.1f}")
            ex.report()
            return
        train(a, t, steps_list, big)
    finally:
        shutil.rmtree(t, ignore_errors=True)


def train(a: Any, t: Path, steps_list: list[int], big: Any) -> None:
    """The training arms, each tool in a process of its own (as a researcher runs it: importing one
    tool's package changes the other's speed, e.g. dictionary_learning imports nnsight, which mounts
    ``.save`` on every Python object), then the export's rounds in this process."""
    store = ingest(t, "c", a.docs, a.context)
    sel = store.select()
    n = len(sel)
    big = big if big is not None else sel
    sizes = export_sizes(a, big, [n])
    print(f"load average at the start: {os.getloadavg()[0]:.1f}")
    print(
        f"store: {n} positions, d_model {store.geometry.d_model}, float16; steps {steps_list} x batch "
        f"{a.batch}; export sizes {sizes} (store of {len(big)} positions)"
    )
    for key in TOOLS:
        out = t / f"{key}.json"
        cmd = [sys.executable, __file__, "--tool", key, "--tool-store", str(t / "c"), "--tool-out", str(out)]
        cmd += ["--context", str(a.context), "--steps", a.steps, "--batch", str(a.batch)]
        subprocess.run([*cmd, "--rounds", str(a.rounds)], check=True)
        got = {tuple(k.split("|")): v for k, v in json.loads(out.read_text()).items()}
        for steps in steps_list:
            for arm, ref in (("loader", "mem"), ("export", "export_mem")):
                if (arm, str(steps)) not in got:
                    continue
                x, y = got[(arm, str(steps))], got[(ref, str(steps))]
                w = [med([r[i] for r in x]) for i in range(4)]
                v = [med([r[i] for r in y]) for i in range(4)]
                bw, bv = max(r[0] for r in x), max(r[0] for r in y)
                print(
                    f"{TOOLS[key]} {steps} steps from the {arm}: whole run {w[0]:.1f} vs {v[0]:.1f} steps/s "
                    f"= {w[0] / v[0]:.3f}x (best of {len(x)}: {bw:.1f} vs {bv:.1f} = {bw / bv:.3f}x); "
                    f"steady {w[1]:.1f} vs {v[1]:.1f} = {w[1] / v[1]:.3f}x; per CPU-second {w[3]:.1f} vs "
                    f"{v[3]:.1f} = {w[3] / v[3]:.3f}x; first batch after {1e3 * w[2]:.0f} vs {1e3 * v[2]:.0f} ms"
                )
    ex = Exports(big, sizes, a.context, t, load_export(a.before) if a.before else None)
    for rnd in range(a.rounds):
        ex.round(rnd)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    ex.report()


TOOLS = {"dl": "trainSAE", "sl": "SAETrainer"}


def tool_arms(a: Any) -> None:
    """One tool's four arms (``--tool``), run in this process only: rounds interleaved, in reverse every
    other round (load drifts); the (whole, steady, first-batch) triples written to ``--tool-out``."""
    steps_list = [int(v) for v in a.steps.split(",")]
    store = actstore.open(a.tool_store)
    sel = store.select()
    n = len(sel)
    d = store.geometry.d_model

    def feed() -> Any:
        return sel.loader("resid", layers=[1], batch_size=a.batch, epochs=None, flatten=True, seed=0)

    # the same rows and batches, in memory (SAETrainer counts samples: an epoch's last batch is short,
    # so it takes one batch more per epoch boundary)
    top = max(steps_list)
    extra = top + top * a.batch // n + 2
    mem = [x for _, x in zip(range(extra), feed())]
    with quiet():
        ds = sel.to_hf_dataset(
            Path(a.tool_out).with_suffix(".hf"), "resid", layers=[1], context_size=a.context
        )
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

    if a.tool == "dl":
        from dictionary_learning import AutoEncoder
        from dictionary_learning.trainers import StandardTrainer
        from dictionary_learning.training import trainSAE

        def fn(data: Any, steps: int) -> None:
            cfg = dict(
                trainer=StandardTrainer,
                dict_class=AutoEncoder,
                activation_dim=d,
                dict_size=4 * d,
                lr=1e-3,
                device="cpu",
                steps=steps,
                layer=1,
                lm_name="m",
                warmup_steps=10,
                sparsity_warmup_steps=10,
            )
            with quiet():
                trainSAE(data=data, trainer_configs=[cfg], steps=steps, device="cpu")

    else:
        from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
        from sae_lens.config import SAETrainerConfig

        def fn(data: Any, steps: int) -> None:
            sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=d, d_sae=4 * d))
            cfg = SAETrainerConfig(
                total_training_samples=steps * a.batch, train_batch_size_samples=a.batch, lr_end=3e-4
            )
            with quiet():
                SAETrainer(cfg, sae, data_provider=data).fit()

    arms = {
        "loader": feed,
        "mem": lambda: iter(mem),
        "export": export_feed,
        "export_mem": lambda: iter(mem_export),
    }
    got: dict[str, list[tuple[float, float, float, float]]] = {}
    for rnd in range(a.rounds):
        for steps in steps_list:
            for arm, make in list(arms.items())[:: 1 if rnd % 2 == 0 else -1]:
                if arm.startswith("export") and steps != steps_list[0]:
                    continue
                got.setdefault(f"{arm}|{steps}", []).append(run(fn, make, steps))
    Path(a.tool_out).write_text(json.dumps(got))


if __name__ == "__main__":
    main()
