"""GPU ingest throughput (tokens/s) against a plain forward, for the device machine.

Random-weight models of two real geometries (no hub or model package needed there):
SmolLM2-135M's (30 layers, 9 heads, 3 kv heads, d_model 576) and a Llama-3.2-1B-class
one (16 layers, 32 heads, 8 kv heads, d_model 2048, d_mlp 8192).  Throughput does not
depend on the weights' values.  Prompts are random token ids of 32..64 tokens.

    python benchmarks/bench_gpu.py --device cuda --out result.json          # on the GPU machine
    python benchmarks/bench_gpu.py --device cpu --tiny --out /tmp/r.json    # smoke test here
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from typing import Any

import torch

GEOMETRIES: dict[str, dict[str, int]] = {
    "smollm2-135m-shape": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
    ),
    "llama-1b-shape": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
    ),
}


def make_prompts(n: int, vocab: int, seed: int) -> list[Any]:
    from actstore.ingest.records import PromptRecord, TokenizedPrompt

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(32, 65, (1,), generator=g))
        ids = torch.randint(3, min(vocab, 512), (length,), generator=g).tolist()
        rec = PromptRecord(text=" ".join(map(str, ids)), relation_id=f"r{i % 8}", subject="s", object="")
        out.append(TokenizedPrompt(rec, ids, [(0, 0)] * length, length - 1, None, None))
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench(name: str, device: str, n: int, batch: int, rounds: int) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from actstore.ingest.capture.batches import pad_batch
    from actstore.ingest.models.tiny import tiny_tokenizer
    from actstore.ingest.pipeline import ingest_prompts
    from actstore.ingest.settings import IngestConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**GEOMETRIES[name], tie_word_embeddings=True, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval().requires_grad_(False)
    tok = tiny_tokenizer()
    prompts = make_prompts(n, cfg.vocab_size, 0)
    tokens = sum(p.target_position + 1 for p in prompts)
    dev = torch.device(device)
    batches = [pad_batch(prompts[i : i + batch], 0, "right", dev) for i in range(0, n, batch)]

    def plain() -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b in batches:
                model.model(
                    input_ids=b.input_ids,
                    attention_mask=b.attention_mask,
                    position_ids=b.position_ids,
                    use_cache=False,
                )
        sync(device)
        return time.perf_counter() - t0

    def ingest() -> float:
        out = tempfile.mkdtemp() + "/s"
        c = IngestConfig(
            out=out,
            batch_size=batch,
            storage_dtype="bfloat16",
            segment_size=batch * 8,
            device=device,
            progress=False,
        )
        sync(device)
        t0 = time.perf_counter()
        ingest_prompts(model, tok, {"name": name}, prompts, c)
        sync(device)
        dt = time.perf_counter() - t0
        shutil.rmtree(out, ignore_errors=True)
        return dt

    plain()  # warm-up
    res: dict[str, list[float]] = {"plain": [], "ingest": []}
    for _ in range(rounds):
        res["plain"].append(plain())
        res["ingest"].append(ingest())
    best = {k: min(v) for k, v in res.items()}
    return {
        "model": name,
        "prompts": n,
        "tokens": tokens,
        "batch": batch,
        "device": device,
        "seconds": res,
        "plain_tokens_per_s": tokens / best["plain"],
        "ingest_tokens_per_s": tokens / best["ingest"],
        "ingest_over_plain": best["ingest"] / best["plain"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="smoke test with a tiny geometry")
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="gpu-result.json")
    args = ap.parse_args()
    names = ["tiny"] if args.tiny else ["smollm2-135m-shape", "llama-1b-shape"]
    results = []
    for name in names:
        r = bench(name, args.device, args.prompts, args.batch, args.rounds)
        print(json.dumps(r), flush=True)
        results.append(r)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
