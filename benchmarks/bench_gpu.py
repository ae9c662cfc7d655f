"""The device machine's figures, one part per process (benchmarks/gpu.sh runs them; docs/gpu.md).

    python benchmarks/bench_gpu.py env --out env.json
    python benchmarks/bench_gpu.py ingest --model llama-3.2-1b --out part.json --budget-s 70
    python benchmarks/bench_gpu.py loader --out part.json --budget-s 45
    python benchmarks/bench_gpu.py merge --work DIR --out gpu-result.json
    (--device cpu --tiny: the same code on this machine's CPU, tiny sizes: bash benchmarks/gpu.sh --cpu)

``ingest``: a random-weight bfloat16 model of a real geometry (SmolLM2-135M, Llama-3.2-1B,
Llama-3.1-8B; the config built here, no hub; throughput does not depend on the weights' values)
ingests random token sequences in target mode (one target a prompt, every per-source factor stored)
and in corpus mode (every position; each kind alone, then all four), against a plain forward of
the same batches (the whole model, logits at every position; and its backbone alone).  Tokens/s
count the real (unpadded) tokens fed to the model; the ingest's time is its own timer (capture,
host copy, compression and writes; store creation excluded, reported as ``create_s``).  A run's
size is what ``--run-bytes`` of captured values allow.  Runs go in a fixed order; one that would pass
the budget is skipped (recorded), and the part file is rewritten after each run, so a process
stopped by its time limit leaves what it measured.

``loader``: a corpus store of SmolLM2-shaped ``resid`` at one layer, then a sparse autoencoder's
training step on the device fed by ``Selection.loader`` against the same step fed from the same rows
already in device memory (a random permutation each epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np

try:
    import torch
except ImportError:  # merge needs no torch: a broken torch still gets its JSON
    torch = None  # type: ignore[assignment]

REPO = Path(__file__).resolve().parents[1]

# Real geometries (the config.json values that set the cost: sizes, vocabulary, tied embeddings; the
# rotary settings cost nothing and are left at the defaults).
GEOMETRIES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
}
# --tiny: each geometry shrunk to a CPU smoke test (its tying kept).
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
)
# Per model: prompts a target-mode batch, windows a corpus-mode batch (of --context tokens).
BATCH = {"smollm2-135m": (64, 32), "llama-3.2-1b": (64, 16), "llama-3.1-8b": (32, 4)}
CORPUS_KINDS = ("all", "resid", "mlp", "z", "attn")  # "all": the four together (attn and z both keep z)
PARTS: tuple[str, ...] = (
    "install",
    "env",
    "exactness-float32",
    "exactness-bfloat16",
    "ingest-smollm2-135m",
    "ingest-llama-3.2-1b",
)
PARTS += ("ingest-llama-3.1-8b", "loader")


# ---------------------------------------------------------------------------------------- shared
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def budget(args: argparse.Namespace) -> float:
    """This process's time limit: --budget-s, or less where gpu.sh's step had less left ($STEP_BUDGET_S)."""
    return min(args.budget_s, float(os.environ.get("STEP_BUDGET_S") or "inf"))


def write_json(path: str | Path, data: Any) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def build_model(name: str, device: str, dtype: torch.dtype, tiny: bool) -> Any:
    """A random-weight Llama-architecture model of ``name``'s geometry, built on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    geo = GEOMETRIES[name] | (TINY if tiny else {})
    cfg = LlamaConfig(**geo, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return model.eval().requires_grad_(False)


def model_info(name: str) -> dict[str, Any]:
    return {"name": f"random-{name}", "architecture": "llama", "weight_hash": f"random-seed0-{name}"}


WORDS = (
    "the capital of France is Paris and river flows through city north south old new company was founded by "
    "in year played music band album film directed wrote novel language spoken born school university "
    "mountain ocean largest country museum holds famous paintings team league home games father mother "
    "teacher doctor worked studied later moved president elected first person walk moon"
).split()


def random_words(n_docs: int, words: int, seed: int) -> list[str]:
    """``n_docs`` documents of ``words`` random English words each."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, words)) for _ in range(n_docs)]


def documents(texts: list[str], where: Path) -> Any:
    from actstore.ingest.datasets.text_corpus import load_documents

    where.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return load_documents(f"text:{where}")


def corpus_plan(docs: Any, tokenizer: Any, context: int) -> Any:
    from actstore.ingest.corpus_windows import plan_corpus

    return plan_corpus(
        docs, tokenizer, context_length=context, keep_special=False, pack=False, separator=None
    )


def ingest_corpus_store(
    out: Path,
    model: Any,
    tok: Any,
    name: str,
    docs: Any,
    plan: Any,
    kinds: tuple[str, ...],
    layers: Any,
    **cfg: Any,
) -> Any:
    """A corpus-mode store at ``out`` (``kinds`` kept, ``layers`` or all); the capture's report."""
    from actstore.core.lock import writer_lock
    from actstore.core.storage import locate
    from actstore.ingest.capture.architectures import architecture_for
    from actstore.ingest.corpus import capture_positions, kept_arrays
    from actstore.ingest.settings import IngestConfig

    kept = kept_arrays(architecture_for(model).geometry(model), kinds, layers)
    c = IngestConfig(out=str(out), progress=False, extra={"dataset": docs.spec, "kinds": list(kinds)}, **cfg)
    loc = locate(str(out))
    with writer_lock(loc):
        return capture_positions(loc, model, tok, model_info(name), docs, plan, kept, c)


def forward_seconds(report: Any) -> float:
    """The capture's own forward time of an ingest report (``forward_seconds``; ``forward_s`` before)."""
    return float(getattr(report, "forward_seconds", getattr(report, "forward_s", float("nan"))))


def padded(rows: list[np.ndarray], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and mask of token rows."""
    T = max(r.size for r in rows)
    ids = torch.zeros((len(rows), T), dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : r.size] = torch.from_numpy(np.asarray(r, dtype=np.int64))
        mask[b, : r.size] = 1
    return ids.to(device), mask.to(device)


def time_forward(
    model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]], device: str, backbone: bool
) -> float:
    """Seconds of one pass over ``batches``: the whole model (logits at every position) or its backbone."""
    run = model.model if backbone else model
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batches:
            run(input_ids=ids, attention_mask=mask, use_cache=False)
    sync(device)
    return time.perf_counter() - t0


def forward_rates(model: Any, batches: list[Any], tokens: int, device: str, min_s: float) -> dict[str, float]:
    """Tokens/s of the plain forward and the backbone alone over ``batches`` (best of passes filling ``min_s``)."""
    out = {}
    for key, backbone in (("plain_forward", False), ("backbone", True)):
        time_forward(model, batches[:1], device, backbone)  # warm-up
        best, spent = float("inf"), 0.0
        while spent < min_s or best == float("inf"):
            dt = time_forward(model, batches, device, backbone)
            best, spent = min(best, dt), spent + dt
        out[f"{key}_tokens_per_s"] = tokens / best
    return out


# ---------------------------------------------------------------------------------------- env
def cmd_env(args: argparse.Namespace) -> None:
    """Versions, the device, and whether every requirement of actstore and of the carried wheels holds."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env |= {
            "gpu": p.name,
            "gpu_memory_gib": round(p.total_memory / 2**30, 1),
            "sm_count": p.multi_processor_count,
        }
    reqs = [
        Requirement(r)
        for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    ]
    site = Path(args.site) if args.site else None
    if site and site.is_dir():
        for d in sorted(site.glob("*.dist-info")):
            dist = metadata.Distribution.at(d)
            env.setdefault("carried", []).append(f"{dist.metadata['Name']}=={dist.version}")
            reqs += [Requirement(r) for r in dist.requires or []]
    versions, problems = {}, []
    for r in reqs:
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        try:
            v = metadata.version(r.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{r} is not installed")
            continue
        versions[r.name] = v
        if r.specifier and not r.specifier.contains(v, prereleases=True):
            problems.append(f"{r}: {v} is installed")
    env["versions"] = dict(sorted(versions.items()))
    env["requirement_problems"] = sorted(set(problems))
    env["errors"] = [f"requirement: {p}" for p in env["requirement_problems"]]
    try:  # the import chain: the capture (torch, transformers), the store (zarr, duckdb), the loader
        import actstore
        import actstore.ingest.pipeline  # noqa: F401
        import actstore.query.select.loader  # noqa: F401

        env["actstore"] = actstore.__file__
    except Exception as exc:
        env["errors"].append(f"import: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    write_json(args.out, env)
    print(json.dumps(env, indent=2))


# ---------------------------------------------------------------------------------------- ingest
def target_prompts(n: int, seed: int) -> list[Any]:
    """``n`` prompts of 32..64 random token ids (the tiny tokenizer's ids), the last one the target."""
    from actstore.ingest.records import PromptRecord, TokenizedPrompt

    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(g.integers(32, 65))
        ids = g.integers(3, 512, length).tolist()
        rec = PromptRecord(text=" ".join(map(str, ids)), relation_id=f"r{i % 8}", subject="s", object="")
        out.append(TokenizedPrompt(rec, ids, [(0, 0)] * length, length - 1, None, None))
    return out


class Runs:
    """The part file of one model: rewritten after each run; a run that would pass the deadline is skipped."""

    def __init__(self, out: str, deadline: float, head: dict[str, Any]) -> None:
        self.out, self.deadline, self.data = out, deadline, head | {"runs": {}, "skipped": [], "errors": []}
        self.save()

    def save(self) -> None:
        write_json(self.out, self.data)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, key: str, need_s: float, fn: Any) -> Any:
        if self.left() < need_s:
            self.data["skipped"].append(
                f"{key}: {self.left():.0f} s left of the budget, about {need_s:.0f} s needed"
            )
            self.save()
            return None
        try:
            result = fn()
        except Exception as exc:  # recorded, and the next run goes on
            self.data["errors"].append(f"{key}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            self.save()
            return None
        self.data["runs"][key] = result
        self.save()
        print(key, json.dumps(result), flush=True)
        return result


def target_bytes_per_prompt(g: Any, tokens: float, storage_dtype: str) -> float:
    """Bytes a target-mode prompt of ``tokens`` tokens stores (before compression): V and A per token,
    z, mlp and resid at the target."""
    from actstore.ingest.corpus import BYTES

    per_token = g.n_layers * (g.n_kv_heads * g.d_head + g.n_heads)
    at_target = g.n_layers * (g.n_heads * g.d_head + g.d_mlp) + (g.n_layers + 1) * g.d_model
    return float(BYTES[storage_dtype] * (tokens * per_token + at_target))


def placeholder_weights_after_first_store() -> None:
    """Each model's first store gets its real weights (float32 on the host, written uncompressed: for
    Llama-3.1-8B about 14 GB); the later stores of this process one number per weight.  The ingest's
    tokens/s exclude store creation either way; only the first run's ``create_s`` is the real cost."""
    from actstore.ingest.capture.architectures import Architecture

    real = Architecture.weights

    def weights(self: Any, model: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        key = id(model)
        if key not in seen:
            w, attrs = real(self, model)
            seen[key] = ({k: np.zeros(1, np.float32) for k in w}, attrs)
            return w, attrs
        return seen[key]

    seen: dict[int, tuple[dict[str, np.ndarray], dict[str, Any]]] = {}
    Architecture.weights = weights  # type: ignore[method-assign]


def cmd_ingest(args: argparse.Namespace) -> None:
    from actstore.ingest.capture.architectures import architecture_for
    from actstore.ingest.capture.batches import pad_batch
    from actstore.ingest.corpus import bytes_per_row, kept_arrays
    from actstore.ingest.models.tiny import tiny_tokenizer
    from actstore.ingest.pipeline import ingest_prompts
    from actstore.ingest.settings import IngestConfig

    start = time.monotonic()
    deadline = start + budget(args) - 5  # 5 s to spare for the last save
    device, name = args.device, args.model
    t0 = time.perf_counter()
    model = build_model(name, device, torch.bfloat16, args.tiny)
    g = architecture_for(model).geometry(model)
    head = {
        "model": name,
        "geometry": {
            k: getattr(g, k) for k in ("n_layers", "n_heads", "n_kv_heads", "d_head", "d_model", "d_mlp")
        },
        "tiny": args.tiny,
        "device": device,
        "model_dtype": "bfloat16",
        "storage_dtype": args.storage_dtype,
        "build_model_s": time.perf_counter() - t0,
        "gpu_memory_after_build_gib": torch.cuda.memory_allocated() / 2**30
        if device.startswith("cuda")
        else None,
        "weights_written": "first store only (later stores: placeholders; creation is not in ingest_s)",
    }
    placeholder_weights_after_first_store()
    runs = Runs(args.out, deadline, head)
    tok = tiny_tokenizer()
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=args.work))
    p_batch, w_batch = (4, 2) if args.tiny else BATCH[name]
    min_s = 0.1 if args.tiny else 1.0  # plain forward: best of passes filling this

    def finish(r: dict[str, Any], base: dict[str, float]) -> dict[str, Any]:
        rate = r["tokens"] / r["ingest_s"]
        return r | {
            "ingest_tokens_per_s": rate,
            "ingest_with_create_tokens_per_s": r["tokens"] / r["wall_s"],
            "ingest_over_plain_forward": base["plain_forward_tokens_per_s"] / rate,
            "ingest_over_backbone": base["backbone_tokens_per_s"] / rate,
        }

    def timed(fn: Any, out: Path) -> tuple[Any, float, int]:
        sync(device)
        t = time.perf_counter()
        rep = fn()
        sync(device)
        wall = time.perf_counter() - t
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        shutil.rmtree(out, ignore_errors=True)
        return rep, wall, size

    # target mode: prompts of 32..64 random tokens, as many as --run-bytes of captured values allow
    def target_mode() -> dict[str, Any]:
        per_prompt = target_bytes_per_prompt(g, 48.5, args.storage_dtype)
        seg = p_batch * 8
        n = int(min(args.max_prompts, args.run_bytes / per_prompt)) // seg * seg
        n = max(n, seg)
        prompts = target_prompts(n, seed=1)
        tokens = sum(p.target_position + 1 for p in prompts)
        dev = torch.device(device)
        batches = []
        for i in range(0, n, p_batch):
            b = pad_batch(prompts[i : i + p_batch], 0, "right", dev)
            batches.append((b.input_ids, b.attention_mask))
        base = forward_rates(model, batches, tokens, device, min_s)  # also the capture's warm-up
        del batches
        out = work / "target"
        c = IngestConfig(
            out=str(out),
            batch_size=p_batch,
            storage_dtype=args.storage_dtype,
            segment_size=seg,
            device=device,
            progress=False,
            overwrite=True,
        )
        rep, wall, size = timed(lambda: ingest_prompts(model, tok, model_info(name), prompts, c), out)
        r = {
            "prompts": n,
            "tokens": tokens,
            "batch_prompts": p_batch,
            "bytes_per_prompt": per_prompt,
            "wall_s": wall,
            "ingest_s": rep.seconds,
            "forward_s": forward_seconds(rep),
            "create_s": wall - rep.seconds,
            "store_bytes": size,
        }
        return finish(r | base, base)

    runs.run("target", 1 if args.tiny else 20, target_mode)

    # corpus mode: documents of random words cut into windows of --context tokens, every position kept
    words = 8 if args.tiny else 300
    docs = documents(random_words(args.max_docs, words, seed=2), work / "corpus.txt")
    plan = corpus_plan(docs, tok, args.context)
    win_tokens = np.array([w.ids.size for w in plan.windows])

    def corpus_baseline() -> dict[str, float]:
        n = min(len(plan.windows), 4 * w_batch)
        batches = [
            padded([plan.windows[w].ids for w in range(i, min(i + w_batch, n))], device)
            for i in range(0, n, w_batch)
        ]
        return forward_rates(model, batches, int(win_tokens[:n].sum()), device, min_s)

    def corpus_mode(kind: str, base: dict[str, float]) -> dict[str, Any]:
        kinds = ("resid", "mlp", "attn", "z") if kind == "all" else (kind,)
        per_row = bytes_per_row(g, kept_arrays(g, kinds, None), args.storage_dtype)
        want = args.run_bytes / per_row  # positions
        n_windows = int(np.searchsorted(np.cumsum(win_tokens), want)) + 1
        n_windows = max(2 * w_batch, min(n_windows, len(plan.windows)) // w_batch * w_batch)
        n_windows = min(n_windows, len(plan.windows))
        sub = corpus_plan_prefix(plan, n_windows)
        out = work / "corpus"
        cfg = dict(
            batch_size=w_batch,
            segment_size=args.segment_positions,
            storage_dtype=args.storage_dtype,
            device=device,
            overwrite=True,
        )
        rep, wall, size = timed(
            lambda: ingest_corpus_store(out, model, tok, name, docs, sub, kinds, None, **cfg), out
        )
        r = {
            "kinds": list(kinds),
            "windows": n_windows,
            "batch_windows": w_batch,
            "context": args.context,
            "tokens": int(win_tokens[:n_windows].sum()),
            "positions": sub.n_rows,
            "bytes_per_position": per_row,
            "wall_s": wall,
            "ingest_s": rep.seconds,
            "forward_s": forward_seconds(rep),
            "create_s": wall - rep.seconds,
            "store_bytes": size,
        }
        return finish(r, base)

    base = runs.run("corpus_plain_forward", 1 if args.tiny else 5, corpus_baseline)
    if base is not None:
        for kind in CORPUS_KINDS:
            runs.run(f"corpus_{kind}", 1 if args.tiny else 15, lambda kind=kind: corpus_mode(kind, base))
    shutil.rmtree(work, ignore_errors=True)
    runs.data["total_s"] = time.monotonic() - start
    runs.save()


def corpus_plan_prefix(plan: Any, n_windows: int) -> Any:
    """The plan of the first ``n_windows`` windows (rows renumbered from 0 as they already are)."""
    from dataclasses import replace

    policy = dict(plan.policy) | {"windows": n_windows}
    return replace(
        plan, windows=plan.windows[:n_windows], row_start=plan.row_start[: n_windows + 1], policy=policy
    )


# ---------------------------------------------------------------------------------------- loader
def make_sae(d: int, k: int, l1: float = 1e-3) -> Any:
    """A ReLU sparse autoencoder: f = relu((x - b_dec) W_enc + b_enc), x^ = f W_dec + b_dec;
    loss = |x^ - x|^2 + l1 |f|_1 (means over the batch)."""

    class SAE(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = torch.randn(d, k) * d**-0.5
            self.W_enc = torch.nn.Parameter(w)
            self.W_dec = torch.nn.Parameter(w.T.clone())
            self.b_enc = torch.nn.Parameter(torch.zeros(k))
            self.b_dec = torch.nn.Parameter(torch.zeros(d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            f = torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)
            xh = f @ self.W_dec + self.b_dec
            return ((xh - x) ** 2).sum(-1).mean() + l1 * f.abs().sum(-1).mean()

    return SAE()


def cmd_loader(args: argparse.Namespace) -> None:
    from actstore import open as open_store
    from actstore.ingest.models.tiny import tiny_tokenizer

    start = time.monotonic()
    device, name = args.device, "smollm2-135m"
    model = build_model(name, device, torch.bfloat16, args.tiny)
    layer = model.config.num_hidden_layers // 2
    tok = tiny_tokenizer()
    work = Path(tempfile.mkdtemp(prefix="bench-loader-", dir=args.work))
    words = 8 if args.tiny else 300
    docs = documents(random_words(max(1, args.rows // (words + 1)) + 1, words, seed=3), work / "corpus.txt")
    plan = corpus_plan(docs, tok, args.context)
    n_windows = int(np.searchsorted(plan.row_start, args.rows)) + 1
    plan = corpus_plan_prefix(plan, min(n_windows, len(plan.windows)))
    t = time.perf_counter()
    ingest_corpus_store(
        work / "s",
        model,
        tok,
        name,
        docs,
        plan,
        ("resid",),
        (layer,),
        batch_size=2 if args.tiny else 32,
        segment_size=args.segment_positions,
        device=device,
        overwrite=True,
    )
    result: dict[str, Any] = {
        "model": name,
        "tiny": args.tiny,
        "device": device,
        "kind": "resid",
        "layer": layer,
        "rows": plan.n_rows,
        "storage_dtype": "float16",
        "store_build_s": time.perf_counter() - t,
        "batch_size": args.batch,
        "sae": f"{args.expansion} x d_model latents, ReLU, Adam, bfloat16 autocast on CUDA",
        "steps": {},
        "skipped": [],
        "errors": [],
    }
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    write_json(args.out, result)
    store = open_store(work / "s")
    sel = store.select()
    d = store.geometry.d_model
    torch.manual_seed(0)
    sae = make_sae(d, args.expansion * d).to(device)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-4)
    autocast = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device.startswith("cuda") else None
    B = args.batch

    def step(x: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        if autocast is not None:
            with autocast:
                loss = sae(x)
        else:
            loss = sae(x)
        loss.backward()
        opt.step()

    def from_loader(workers: int, train: bool) -> float:
        feed = sel.loader(
            "resid", layers=[layer], batch_size=B, flatten=True, drop_last=True, workers=workers
        )
        if len(feed) == 0:
            raise ValueError(f"{len(sel)} rows make no batch of {B}")
        n, t0 = 0, 0.0
        while n < args.steps + 3:
            for x in feed:
                x = x.to(device, non_blocking=True)
                if train:
                    step(x)
                n += 1
                if n == 3:  # three warm-up steps
                    sync(device)
                    t0 = time.perf_counter()
                if n >= args.steps + 3:
                    break
        sync(device)
        return args.steps / (time.perf_counter() - t0)

    def resident() -> float:
        X = torch.from_numpy(sel.features("resid", layers=[layer]).reshape(len(sel), -1)).to(device)
        per_epoch = len(X) // B
        n, t0, perm = 0, 0.0, torch.randperm(len(X), device=device)
        while n < args.steps + 3:
            i = n % per_epoch
            if i == 0:
                perm = torch.randperm(len(X), device=device)
            step(X[perm[i * B : (i + 1) * B]])
            n += 1
            if n == 3:
                sync(device)
                t0 = time.perf_counter()
        sync(device)
        return args.steps / (time.perf_counter() - t0)

    steps = result["steps"]
    for key, fn in (
        ("resident", resident),
        ("loader_w1", lambda: from_loader(1, True)),
        ("loader_w4", lambda: from_loader(4, True)),
        ("loader_only_w1", lambda: from_loader(1, False)),
    ):
        if time.monotonic() - start > budget(args) - 10:
            result["skipped"].append(key)
            continue
        try:
            steps[f"{key}_steps_per_s"] = fn()
        except Exception as exc:  # recorded, and the next one goes on
            result["errors"].append(f"{key}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            continue
        finally:
            write_json(args.out, result)
        print(key, steps[f"{key}_steps_per_s"], flush=True)
    if "resident_steps_per_s" in steps:
        for w in ("w1", "w4"):
            if f"loader_{w}_steps_per_s" in steps:
                steps[f"loader_{w}_over_resident"] = (
                    steps[f"loader_{w}_steps_per_s"] / steps["resident_steps_per_s"]
                )
    if "loader_only_w1_steps_per_s" in steps:
        result["loader_only_w1_rows_per_s"] = steps["loader_only_w1_steps_per_s"] * B
    result["total_s"] = time.monotonic() - start
    write_json(args.out, result)
    shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------- merge
def junit_summary(path: Path) -> dict[str, Any]:
    """Counts and failures of a pytest --junitxml file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out: dict[str, Any] = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    out["seconds"] = sum(float(s.get("time", 0)) for s in suites)
    bad = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                msg = (el.get("message") or "").strip().splitlines()
                bad.append(f"{case.get('classname')}::{case.get('name')}: {msg[0][:300] if msg else tag}")
    out["failed_tests"] = bad
    return out


def tail(path: Path, lines: int = 25) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return []


def cmd_merge(args: argparse.Namespace) -> None:
    work = Path(args.work)
    result: dict[str, Any] = {"schema": "actstore-gpu/1", "mode": args.mode, "steps": {}, "errors": []}
    for line in (work / "meta.txt").read_text().splitlines() if (work / "meta.txt").exists() else []:
        k, _, v = line.partition("=")
        result[k] = v
    for name in PARTS:
        status_file = work / "status" / f"{name}.json"
        st = json.loads(status_file.read_text()) if status_file.exists() else {"rc": None, "note": "not run"}
        part: Any = None
        xml = work / "parts" / f"{name}.xml"
        js = work / "parts" / f"{name}.json"
        try:
            if xml.exists():
                part = junit_summary(xml)
            elif js.exists():
                part = json.loads(js.read_text())
        except Exception as exc:
            result["errors"].append(f"{name}: its part file is unreadable: {exc}")
        if st.get("rc") != 0 and not st.get("skipped"):
            st["log_tail"] = tail(work / "logs" / f"{name}.log")
            result["errors"].append(
                f"{name}: exit status {st.get('rc')}" + (" (time limit)" if st.get("timed_out") else "")
            )
        if isinstance(part, dict):
            for e in part.get("errors", []) if isinstance(part.get("errors"), list) else []:
                result["errors"].append(f"{name}: {e}")
            for t in part.get("failed_tests", []):
                result["errors"].append(f"{name}: {t}")
        result["steps"][name] = st
        section, _, key = name.partition("-")
        if section == "install":
            continue
        if section == "env":
            result["env"] = part
        else:
            result.setdefault(section, {})[key or "result"] = part
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("mode", "errors")}, indent=2))


# ---------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    env = sub.add_parser("env")
    env.add_argument("--out", required=True)
    env.add_argument("--site", default="", help="the folder the carried wheels were installed into")
    for cmd in ("ingest", "loader"):
        p = sub.add_parser(cmd)
        p.add_argument("--out", required=True)
        p.add_argument("--device", default="cuda")
        p.add_argument("--tiny", action="store_true", help="tiny geometry and sizes (a CPU smoke test)")
        p.add_argument("--budget-s", type=float, default=60.0, help="this process's time limit")
        p.add_argument("--work", default=None, help="where the temporary stores go")
        p.add_argument("--context", type=int, default=256, help="corpus mode: tokens a window")
        p.add_argument("--segment-positions", type=int, default=4096, help="corpus mode: positions a segment")
    ing = sub.choices["ingest"]
    ing.add_argument("--model", choices=sorted(GEOMETRIES), required=True)
    ing.add_argument("--storage-dtype", default="bfloat16", choices=("float16", "bfloat16", "float32"))
    ing.add_argument(
        "--run-bytes", type=float, default=2e9, help="captured values a run (before compression): its size"
    )
    ing.add_argument("--max-prompts", type=int, default=8192)
    ing.add_argument("--max-docs", type=int, default=2000, help="corpus mode: documents of 300 words")
    lo = sub.choices["loader"]
    lo.add_argument("--rows", type=int, default=1 << 17)
    lo.add_argument("--batch", type=int, default=4096)
    lo.add_argument("--steps", type=int, default=200)
    lo.add_argument("--expansion", type=int, default=16, help="SAE latents per input dimension")
    mg = sub.add_parser("merge")
    mg.add_argument("--work", required=True)
    mg.add_argument("--out", required=True)
    mg.add_argument("--mode", default="gpu")
    args = ap.parse_args(argv)
    {"env": cmd_env, "ingest": cmd_ingest, "loader": cmd_loader, "merge": cmd_merge}[args.cmd](args)


if __name__ == "__main__":
    main()
