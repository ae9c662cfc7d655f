"""What a store's model is, in words: the packaged aliases name their checkpoint and quantisation.

The packaged models are GGUF files dequantised to float32 when converted; every exactness claim
(the decompositions sum to the model's own activations) holds with respect to those dequantised
weights, not to the original full-precision checkpoint.
"""

from __future__ import annotations

from typing import Any

MODEL_DESCRIPTIONS = {
    "smollm2-135m": "SmolLM2-135M-Instruct, Q4_1 GGUF dequantised to float32",
    "gemma3-270m": "Gemma 3 270M, Q4_K_M GGUF dequantised to float32",
}


def describe_model(model: dict[str, Any]) -> str:
    """``name`` and, for a packaged alias or a tiny model, what it is: ``smollm2-135m (SmolLM2-135M-Instruct,
    Q4_1 GGUF dequantised to float32)``."""
    name = str(model.get("name"))
    what = MODEL_DESCRIPTIONS.get(name.lower())
    if what is None and name.lower().startswith("tiny-"):
        what = "random weights, for tests"
    return f"{name} ({what})" if what else name


#: Environment variables that keep the hub offline (any value but "", "0", "false", "no", "off").
OFFLINE_ENV = ("ACTSTORE_OFFLINE", "HF_HUB_OFFLINE")


def hub_offline(timeout: float = 1.5) -> str | None:
    """Why the hub cannot be reached, or None where it may be: an offline variable of
    :data:`OFFLINE_ENV` set (read now, not when huggingface_hub was imported), or the endpoint's host
    not resolving or not taking a connection within ``timeout`` seconds (one try, no retries; skipped
    behind a proxy, which only a request through it can test)."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    for var in OFFLINE_ENV:
        if os.environ.get(var, "").strip().lower() not in ("", "0", "false", "no", "off"):
            return f"{var} is set"
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return None
    except OSError as e:
        return f"{constants.ENDPOINT} cannot be reached ({' '.join(str(e).split())[:80]})"
