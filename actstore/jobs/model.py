"""The store's model for the jobs that run it (tracing, patching, ablation, MAPS through the first
MLP): the model named, else the store's own when that is one of actstore's aliases (a name read
from a store is never loaded from a folder or the hub on its own); its weights must match the
store's unless ``allow_other_model``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from actstore.core.dependencies import transformers_logging
from actstore.core.errors import InvalidSetting
from actstore.core.settings import DEFAULT_DEVICE, DEFAULT_MODEL_DTYPE, check_model_dtype
from actstore.core.store import StoreReader
from actstore.ingest.capture.architectures import architecture_for
from actstore.ingest.capture.first_mlp import first_mlp_transform
from actstore.ingest.models.registry import known_alias, load_model
from actstore.jobs.settings import StoreModelRun


def model_for_store(store: StoreReader, model: str | None) -> str:
    """``model`` when given, else the store's own model when it is one of actstore's aliases."""

    if model:
        return model
    stored = str(store.manifest.model.get("name") or "").strip()
    if not stored:
        raise InvalidSetting("model", f"{store.url} names no model; name the model to load")
    alias = known_alias(stored)
    if alias is None:
        raise InvalidSetting(
            "model",
            f"the store's model {stored!r} is not one of actstore's aliases, and a name "
            "read from a store is never loaded from disk or the hub on its own; name the "
            "model to load",
        )
    return alias


def load_store_model(
    store: StoreReader,
    model: str | None,
    *,
    device: str = DEFAULT_DEVICE,
    model_dtype: str = DEFAULT_MODEL_DTYPE,
    allow_other_model: bool = False,
    quiet: bool = False,
) -> Any:
    """The store's model (see :func:`model_for_store`), loaded; refused when its weights differ from
    the store's unless ``allow_other_model``."""

    check_model_dtype(model_dtype)
    name = model_for_store(store, model)
    if quiet:
        transformers_logging.disable_progress_bar()
    loaded = load_model(name, device=device, dtype=getattr(torch, model_dtype))
    want = str(store.manifest.model.get("weight_hash") or "")
    if want and want != loaded.weight_hash and not allow_other_model:
        raise InvalidSetting(
            "model",
            f"{name!r} has other weights than the store's "
            f"({store.manifest.model.get('name')}); use the store's model, or allow "
            "another model explicitly",
        )
    return loaded


def load_request_model(store: StoreReader, req: StoreModelRun) -> tuple[str, Any]:
    """(the model's name, the model loaded) for a job that runs the store's model, as ``req`` says
    (:func:`load_store_model`)."""
    name = model_for_store(store, req.model)
    loaded = load_store_model(
        store,
        name,
        device=req.device,
        model_dtype=req.model_dtype,
        allow_other_model=req.allow_other_model,
        quiet=req.quiet,
    )
    return name, loaded


def first_mlp_for_store(store: StoreReader, model: str | None) -> Any:
    """The first-MLP source transform of the store's model (loaded on the CPU, float32), for MAPS
    static scores through the first MLP."""

    loaded = load_store_model(store, model)
    return first_mlp_transform(loaded.model)


#: The input sides of a neuron a direction spec may name (``neuron:LAYER:INDEX:in|up``): ``in`` the
#: activation's argument (a gated MLP's gate, else its one input projection), ``up`` a gated MLP's up.
NEURON_INPUTS = {"in": "gate", "up": "up"}


def direction_for(store: StoreReader, spec: str, model: str | None = None) -> np.ndarray:
    """The direction ``spec`` names (:func:`actstore.query.analyses.dfa.load_direction`), where
    ``neuron:LAYER:INDEX:in|up`` (a neuron's input weights, which a store does not keep) is read from
    the store's model (:func:`load_store_model`) and folded with the norm the MLP reads through
    (``Architecture.neuron_input``, ours)."""
    from actstore.query.analyses.dfa import load_direction, neuron_spec

    kind, _, rest = spec.partition(":")
    if kind != "neuron" or rest.rsplit(":", 1)[-1] not in NEURON_INPUTS:
        return load_direction(store, spec)
    layer, index, side = neuron_spec(store, rest)
    loaded = load_store_model(store, model, quiet=True)
    try:
        u = architecture_for(loaded.model).neuron_input(loaded.model, layer, index, NEURON_INPUTS[side])
    except ValueError as e:
        raise InvalidSetting("direction", str(e)) from None
    return u
