"""actstore ingest against the ways a researcher captures the same data today, side by side.

One run, one model (SmolLM2-135M, float32, CPU), the same FewRel prompts and batches, and
for every method the same information at the target (last) position of each prompt:

    z      [targets, L, H, d_head]      per-head attention output (the o_proj input)
    attn   [sources, L, H]              attention probabilities of the target row over its sources
    v      [tokens, L, H_kv, d_head]    value vectors of every token (what decomposes z per source)
    mlp    [targets, L, d_mlp]          MLP activations (the down projection's input)
    resid  [targets, L+1, d_model]      residual stream (embeddings, then after each layer)

Methods (each one a complete run over the corpus into a fresh output directory):

* ``plain``        ``model(input_ids, attention_mask)``: the floor, nothing captured or written
* ``backbone``     the decoder stack alone, without the LM head over every position (actstore
                   runs this and applies the head at the target rows only): the strictest floor
* ``actstore``     ``ingest_prompts`` into a new store (fused capture, Blosc/zstd, Zarr + Parquet, commits)
* ``nnsight``      nnsight 0.8.1 ``TransformersModel(model, tokenizer=tok)`` trace, eager attention,
                   ``tracer.stop()`` after the last layer (no LM head, as actstore)
* ``tlens``        TransformerLens 4.x ``TransformerBridge.boot_transformers(..., hf_model=model)``,
                   ``run_with_cache`` with a ``names_filter`` (the bridge computes the logits even
                   with ``stop_at_layer=n_layers``, so this one runs the full model)
* ``hf``           plain transformers on the decoder stack (``model.model``, no LM head):
                   ``output_hidden_states`` + ``output_attentions`` (eager) and forward hooks on
                   ``v_proj``, ``o_proj`` and ``down_proj``
* ``nnsight_full``, ``hf_full``  the same through the whole model, LM head included (the way
                   these tools are usually called); not in the default set, ``--methods`` adds them
* ``materialised`` actstore's capture, then the per-(head, source token) contributions
                   ``A_h(t,j) V(j) W_O,h`` [sources, L, H, d_model] (plus mlp and resid) in float16

The peers gather the same ragged rows actstore stores and write them with ``torch.save``
(one file per batch, float16, uncompressed); ``materialised`` writes with ``numpy.save``.
Before timing, every peer's float32 capture of the first batch is compared with actstore's
(max relative error printed), so the methods provably capture the same numbers.

Rounds run the methods in a shuffled order; each ratio is the median over rounds of
(method time / plain time in the same round), so load from other processes hits all alike.

    python benchmarks/bench_peers.py [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_ingest import du, load  # noqa: E402
from benchmarks.common import emit  # noqa: E402

NAMES = ("z", "attn", "v", "mlp", "resid")
PEERS = ("nnsight", "tlens", "hf", "nnsight_full", "hf_full")


def _rows(t: torch.Tensor, b: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return t[b, p]


class Captured:
    """Per-layer pieces a peer hands over, gathered into actstore's ragged layout."""

    def __init__(self, ix: Any) -> None:
        self.ix = ix
        self.z: list[torch.Tensor] = []
        self.attn: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.mlp: list[torch.Tensor] = []
        self.resid: list[torch.Tensor] = []

    def arrays(self, n_heads: int, d_head: int) -> dict[str, torch.Tensor]:
        nT = self.ix.target_b.numel()
        return {
            "z": torch.stack(self.z, 1).reshape(nT, len(self.z), n_heads, d_head),
            "attn": torch.stack(self.attn, 1),
            "v": torch.stack(self.v, 1).reshape(self.ix.tok_b.numel(), len(self.v), -1, d_head),
            "mlp": torch.stack(self.mlp, 1),
            "resid": torch.stack(self.resid, 1),
        }


def save_batch(out: str, i: int, arrays: dict[str, torch.Tensor]) -> None:
    torch.save(
        {k: v.to(torch.float16).contiguous() for k, v in arrays.items()},
        os.path.join(out, f"batch{i:05d}.pt"),
    )


class Bench:
    """Loaded model copies, padded batches and one ``capture`` function per method."""

    def __init__(self, loaded: Any, prompts: list[Any], batch: int) -> None:
        from actstore.ingest.capture.architectures import architecture_for
        from actstore.ingest.capture.batches import pad_batch

        self.loaded = loaded
        self.prompts = prompts
        self.batch = batch
        self.model = loaded.model
        self.arch = architecture_for(self.model)
        self.g = self.arch.geometry(self.model)
        pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
        self.batches = [
            pad_batch(prompts[i : i + batch], pad, "right", torch.device("cpu"))
            for i in range(0, len(prompts), batch)
        ]
        self._nnsight: Any = None
        self._tlens: Any = None
        self._hf: Any = None
        self._W_O: torch.Tensor | None = None

    # --- the floor ------------------------------------------------------------------------
    def plain(self) -> None:
        with torch.inference_mode():
            for b in self.batches:
                self.model(
                    input_ids=b.input_ids,
                    attention_mask=b.attention_mask,
                    position_ids=b.position_ids,
                    use_cache=False,
                )

    def backbone(self) -> None:
        """The decoder stack alone (no LM head over every position), as actstore runs it."""
        fn = self.arch.backbone(self.model)
        with torch.inference_mode():
            for b in self.batches:
                fn(
                    input_ids=b.input_ids,
                    attention_mask=b.attention_mask,
                    position_ids=b.position_ids,
                    use_cache=False,
                )

    # --- actstore -------------------------------------------------------------------------
    def actstore(self, out: str) -> float:
        """Runs ``ingest_prompts``; returns the seconds after store creation (weights written once per store)."""
        from actstore.ingest.pipeline import ingest_prompts
        from actstore.ingest.settings import IngestConfig

        cfg = IngestConfig(out=out, batch_size=self.batch, storage_dtype="float16", progress=False)
        rep = ingest_prompts(
            self.model,
            self.loaded.tokenizer,
            {"name": self.loaded.name, "weight_hash": self.loaded.weight_hash},
            self.prompts,
            cfg,
        )
        return rep.seconds

    def actstore_capture(self, b: Any) -> dict[str, torch.Tensor]:
        from actstore.ingest.capture.fused import FusedCapture

        with FusedCapture(self.model, self.arch, "float32") as cap:
            out = cap.run(b.input_ids, b.attention_mask, b.index, b.position_ids)
        return {k: out[k] for k in NAMES}

    # --- nnsight --------------------------------------------------------------------------
    def nnsight_full_capture(self, b: Any) -> dict[str, torch.Tensor]:
        return self.nnsight_capture(b, head=True)

    def nnsight_capture(self, b: Any, head: bool = False) -> dict[str, torch.Tensor]:
        if self._nnsight is None:
            from nnsight import TransformersModel

            m = copy.deepcopy(self.model)
            m.set_attn_implementation("eager")  # attention probabilities need eager attention
            self._nnsight = TransformersModel(m, tokenizer=self.loaded.tokenizer)
        nm = self._nnsight
        ix = b.index
        tb, tp = ix.target_b, ix.target_pos
        c = Captured(ix)
        with (
            torch.inference_mode(),
            nm.trace(
                input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids
            ) as tracer,
        ):
            c.resid.append(nm.model.embed_tokens.output[tb, tp].save())
            for layer in nm.model.layers:
                c.v.append(layer.self_attn.v_proj.output[ix.tok_b, ix.tok_pos].save())
                c.z.append(layer.self_attn.o_proj.input[tb, tp].save())
                probs = layer.self_attn.output[1][tb, :, tp]  # [nT, H, T]
                c.attn.append(probs[ix.src_t, :, ix.src_pos].save())
                c.mlp.append(layer.mlp.down_proj.input[tb, tp].save())
                c.resid.append(layer.output[tb, tp].save())
            if not head:
                tracer.stop()  # skip the final norm and the LM head over every position
        return c.arrays(self.g.n_heads, self.g.d_head)

    # --- TransformerLens ------------------------------------------------------------------
    def tlens_capture(self, b: Any) -> dict[str, torch.Tensor]:
        if self._tlens is None:
            import warnings

            from transformer_lens.model_bridge import TransformerBridge

            m = copy.deepcopy(self.model)  # the bridge switches its model to eager attention
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._tlens = TransformerBridge.boot_transformers(
                    m.config.name_or_path, hf_model=m, tokenizer=self.loaded.tokenizer, device="cpu"
                )
        L = self.g.n_layers
        wanted = {"blocks.0.hook_resid_pre"} | {
            f"blocks.{i}.{h}"
            for i in range(L)
            for h in ("attn.hook_z", "attn.hook_pattern", "attn.hook_v", "mlp.hook_post", "hook_resid_post")
        }
        ix = b.index
        tb, tp = ix.target_b, ix.target_pos
        with torch.inference_mode():
            _, cache = self._tlens.run_with_cache(
                b.input_ids, attention_mask=b.attention_mask, names_filter=lambda n: n in wanted
            )
        c = Captured(ix)
        c.resid.append(cache["blocks.0.hook_resid_pre"][tb, tp])
        for i in range(L):
            c.z.append(cache[f"blocks.{i}.attn.hook_z"][tb, tp].flatten(1))  # [B, T, H, dh] -> [nT, H*dh]
            probs = cache[f"blocks.{i}.attn.hook_pattern"][tb, :, tp]  # [B, H, T, T] -> [nT, H, T]
            c.attn.append(probs[ix.src_t, :, ix.src_pos])
            c.v.append(cache[f"blocks.{i}.attn.hook_v"][ix.tok_b, ix.tok_pos].flatten(1))
            c.mlp.append(cache[f"blocks.{i}.mlp.hook_post"][tb, tp])
            c.resid.append(cache[f"blocks.{i}.hook_resid_post"][tb, tp])
        return c.arrays(self.g.n_heads, self.g.d_head)

    # --- plain transformers ---------------------------------------------------------------
    def hf_full_capture(self, b: Any) -> dict[str, torch.Tensor]:
        return self.hf_capture(b, head=True)

    def hf_capture(self, b: Any, head: bool = False) -> dict[str, torch.Tensor]:
        if self._hf is None:
            m = copy.deepcopy(self.model)
            m.set_attn_implementation("eager")  # under SDPA output_attentions returns nothing
            self._hf = m
        m = self._hf if head else self._hf.model  # .model: the decoder stack without the LM head
        ix = b.index
        tb, tp = ix.target_b, ix.target_pos
        c = Captured(ix)
        handles = []
        for layer in self._hf.model.layers:
            handles.append(
                layer.self_attn.v_proj.register_forward_hook(
                    lambda mod, a, o: c.v.append(o[ix.tok_b, ix.tok_pos])
                )
            )
            handles.append(
                layer.self_attn.o_proj.register_forward_pre_hook(lambda mod, a: c.z.append(a[0][tb, tp]))
            )
            handles.append(
                layer.mlp.down_proj.register_forward_pre_hook(lambda mod, a: c.mlp.append(a[0][tb, tp]))
            )
            handles.append(
                layer.register_forward_hook(  # the last hidden state is after the final norm
                    lambda mod, a, o: c.resid.append((o[0] if isinstance(o, tuple) else o)[tb, tp])
                )
            )
        try:
            with torch.inference_mode():
                out = m(
                    input_ids=b.input_ids,
                    attention_mask=b.attention_mask,
                    position_ids=b.position_ids,
                    use_cache=False,
                    output_hidden_states=True,
                    output_attentions=True,
                )
        finally:
            for h in handles:
                h.remove()
        c.resid.insert(0, out.hidden_states[0][tb, tp])
        for a in out.attentions:  # [B, H, T, T]
            c.attn.append(a[tb, :, tp][ix.src_t, :, ix.src_pos])
        return c.arrays(self.g.n_heads, self.g.d_head)

    # --- the materialised way -------------------------------------------------------------
    def materialised_batch(self, b: Any) -> dict[str, np.ndarray]:
        from actstore.ingest.capture.fused import FusedCapture

        if self._W_O is None:
            self._W_O = torch.from_numpy(self.arch.weights(self.model)[0]["W_O"])  # [L, H, dh, d]
        with FusedCapture(self.model, self.arch, "float32") as cap:
            out = cap.run(b.input_ids, b.attention_mask, b.index, b.position_ids)
        kv = torch.arange(self.g.n_heads) // self.g.kv_group
        # One target per example: source j of a target is token j of its example (same flat axis).
        av = out["attn"][..., None] * out["v"][:, :, kv]  # [N_src, L, H, dh]
        contrib = torch.einsum("slhk,lhkd->slhd", av, self._W_O).to(torch.float16)
        return {
            "contrib": contrib.numpy(),
            "mlp": out["mlp"].half().numpy(),
            "resid": out["resid"].half().numpy(),
        }

    # --- timed runs -----------------------------------------------------------------------
    def run_peer(self, name: str, out: str) -> None:
        capture: Callable[[Any], dict[str, torch.Tensor]] = getattr(self, f"{name}_capture")
        os.makedirs(out, exist_ok=True)
        for i, b in enumerate(self.batches):
            save_batch(out, i, capture(b))

    def run_materialised(self, out: str) -> None:
        os.makedirs(out, exist_ok=True)
        for i, b in enumerate(self.batches):
            for k, a in self.materialised_batch(b).items():
                np.save(os.path.join(out, f"batch{i:05d}_{k}.npy"), a)


def check_same(bench: Bench, peers: list[str]) -> dict[str, float]:
    """Max relative error of each peer's float32 capture of batch 0 against actstore's."""
    b = bench.batches[0]
    ref = bench.actstore_capture(b)
    errs: dict[str, float] = {}
    for name in PEERS:
        got = getattr(bench, f"{name}_capture")(b)
        worst = 0.0
        for k in NAMES:
            r, x = ref[k].float(), got[k].float()
            if r.shape != x.shape:
                raise AssertionError(f"{name}: {k} has shape {tuple(x.shape)}, actstore {tuple(r.shape)}")
            worst = max(worst, float((r - x).abs().max() / r.abs().max().clamp(min=1e-12)))
        errs[name] = worst
        if worst > 1e-3:
            raise AssertionError(
                f"{name} does not capture the same numbers as actstore (max rel. error {worst:.2e})"
            )
    # The materialised contributions summed over sources give z W_O (an independent identity).
    m = bench.materialised_batch(b)
    assert bench._W_O is not None
    attn_head = torch.einsum("nlhk,lhkd->nlhd", ref["z"], bench._W_O)
    owner = b.index.src_t
    summed = torch.zeros_like(attn_head).index_add_(0, owner, torch.from_numpy(m["contrib"]).float())
    errs["materialised"] = float((summed - attn_head).abs().max() / attn_head.abs().max())
    return errs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 prompts, 3 rounds")
    ap.add_argument("--prompts", type=int, default=None, help="default 64 (32 with --quick)")
    ap.add_argument("--rounds", type=int, default=None, help="default 5 (3 with --quick)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    ap.add_argument("--methods", default="plain,backbone,actstore,nnsight,tlens,hf,materialised")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    n = args.prompts or (32 if args.quick else 64)
    rounds = args.rounds or (3 if args.quick else 5)
    torch.set_num_threads(args.threads)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "plain" not in methods:
        methods.insert(0, "plain")

    loaded, prompts = load(n)
    bench = Bench(loaded, prompts, args.batch)
    errors = check_same(bench, [m for m in methods if m in PEERS])  # also the warm-up of every method
    tmp = tempfile.mkdtemp(prefix="actstore-peers-")
    times: dict[str, list[float]] = {m: [] for m in methods}
    after_create: list[float] = []
    bytes_on_disk: dict[str, int] = {}
    rng = random.Random(0)
    for _ in range(rounds):
        order = list(methods)
        rng.shuffle(order)
        for name in order:
            out = os.path.join(tmp, name)
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            if name == "plain":
                bench.plain()
            elif name == "backbone":
                bench.backbone()
            elif name == "actstore":
                after_create.append(bench.actstore(out))
            elif name == "materialised":
                bench.run_materialised(out)
            else:
                bench.run_peer(name, out)
            times[name].append(time.perf_counter() - t0)
            if name not in ("plain", "backbone"):
                bytes_on_disk[name] = (
                    du(out, "segments") + du(out, "tables") if name == "actstore" else du(out)
                )
                if name == "actstore":
                    bytes_on_disk["actstore_weights_once"] = du(out, "weights")
            shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)

    def ratio(xs: list[float]) -> float:
        return statistics.median(x / p for x, p in zip(xs, times["plain"]))

    ratios = {m: ratio(times[m]) for m in methods}
    if "actstore" in methods:
        ratios["actstore_after_store_creation"] = ratio(after_create)
        if "backbone" in methods:
            ratios["actstore_over_backbone"] = statistics.median(
                a / b for a, b in zip(times["actstore"], times["backbone"])
            )
            ratios["actstore_after_store_creation_over_backbone"] = statistics.median(
                a / b for a, b in zip(after_create, times["backbone"])
            )
    peers_same = [m for m in PEERS if m in methods]
    result: dict[str, Any] = {
        "model": loaded.name,
        "prompts": n,
        "batch": args.batch,
        "rounds": rounds,
        "threads": args.threads,
        "mean_tokens": sum(p.target_position + 1 for p in prompts) / n,
        "same_numbers_max_rel_error": errors,
        "seconds_median": {m: statistics.median(v) for m, v in times.items()},
        "ratio_to_plain": ratios,
        "bytes_per_target": {k: v / n for k, v in bytes_on_disk.items() if k != "actstore_weights_once"},
        "actstore_weights_bytes_once_per_store": bytes_on_disk.get("actstore_weights_once"),
        "load_average": os.getloadavg(),
    }
    if "actstore" in methods and peers_same:
        fastest = min(peers_same, key=lambda m: ratios[m])
        result["fastest_peer_same_data"] = fastest
        # > 1 means actstore is faster (the target is >= 2).
        result["peer_over_actstore"] = ratios[fastest] / ratios["actstore"]
        result["peer_over_actstore_after_store_creation"] = (
            ratios[fastest] / ratios["actstore_after_store_creation"]
        )
    if "actstore" in methods and "materialised" in methods:
        result["materialised_over_actstore"] = ratios["materialised"] / ratios["actstore"]
    emit(result, args.json_out)


if __name__ == "__main__":
    main()
