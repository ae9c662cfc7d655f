"""The settings of causal tracing (:mod:`actstore.interventions.tracing`) and activation patching
(:mod:`actstore.interventions.patching`), each validated when it is made; :meth:`TraceConfig.validate`
adds what depends on the model.

Torch-free: the command line builds the options of ``actstore trace | patch`` from them without
loading a model.  (The MAPS causal check's settings, which need the MAPS defaults, are
:class:`actstore.query.maps.settings.AblationConfig`.)"""

from __future__ import annotations

from dataclasses import dataclass

from actstore.core.errors import InvalidSetting, PatchError, TraceError
from actstore.core.settings import check_settings, setting

TRACE_COMPONENTS = ("resid", "mlp", "attn")  # restored by causal tracing
PATCH_COMPONENTS = ("resid", "attn", "mlp")  # patched per layer (heads apart)
POSITIONS = ("subject_last", "last")  # the named positions that align two prompts


def check_noise(samples: int, noise_scale: float) -> None:
    """A corrupted run's noise: at least one sample, a scale >= 0 (:class:`TraceError` otherwise)."""
    if samples < 1:
        raise TraceError(f"the number of noise samples must be at least 1, not {samples}")
    if noise_scale < 0:
        raise TraceError(f"the noise scale must be >= 0, not {noise_scale}")


@dataclass(frozen=True)
class TraceConfig:
    """Causal tracing.  ``skip_before_subject``: positions before the subject have IE = 0 exactly and
    are not run (``--all-positions`` runs them)."""

    samples: int = setting(3, "Noise samples per fact.", low=1)  # ROME: 10
    noise_scale: float = setting(
        3.0,
        "Noise std in multiples of the std of the store's subject-token embeddings.",
        flag="--noise",
        low=0,
    )
    window: int = setting(10, "Layers restored together for MLP and attention.", low=1)
    components: tuple[str, ...] = setting(
        TRACE_COMPONENTS, "Components restored (comma-separated).", choices=TRACE_COMPONENTS
    )
    skip_before_subject: bool = setting(
        True, "Also run the positions before the subject (their effect is 0).", flag="--all-positions"
    )
    seed: int = setting(0, "Seed of the noise.")
    # incremental: batch_size x longest prompt positions per forward pass
    batch_size: int = setting(64, "Corrupted copies per forward pass.", low=1)
    max_rows_per_call: int = setting(8192, "Restorations held in memory at once (several facts).", cli=False)
    incremental: bool = setting(
        True, "Restorations reuse the corrupted run (False: recompute every row in full).", cli=False
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.components:
            raise TraceError(f"unknown component '(none)' (one of {', '.join(TRACE_COMPONENTS)})")
        check_noise(self.samples, self.noise_scale)

    def validate(self, n_layers: int) -> None:
        """What depends on the model: the window no larger than its ``n_layers`` (a refused setting)."""
        if self.window > n_layers:
            raise InvalidSetting(
                "window", f"a window of {self.window} layers is larger than the model ({n_layers} layers)"
            )


@dataclass(frozen=True)
class PatchConfig:
    """Activation patching: the sites patched and the batch."""

    components: tuple[str, ...] = setting(
        PATCH_COMPONENTS, "Components patched (comma-separated).", choices=PATCH_COMPONENTS
    )
    positions: tuple[str, ...] = setting(
        POSITIONS,
        "Positions patched: subject_last (the subject's last token), last (the prompt's), or both "
        "(comma-separated).",
        choices=POSITIONS,
    )
    heads: bool = setting(True, "Skip the per-head patches.")
    head_positions: tuple[str, ...] = setting(
        ("last",), "Positions of the per-head patches.", choices=POSITIONS
    )
    batch_size: int = setting(64, "Patched runs per forward pass.", low=1)
    min_denominator: float = setting(
        1e-3, "|LD_clean - LD_cf| below this: recovery undefined (NaN).", cli=False
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.components and not self.heads:
            raise PatchError("nothing to patch: give a component or heads")
