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
