"""An error about one setting of a library call, named by its Python parameter.

Library code never names command-line flags; it raises :class:`InvalidSetting` with the name of
the parameter at fault (``setting="model"``), and the command line shows that setting under the
name of its own option (``--model``).
"""

from __future__ import annotations

from actstore.core.errors import ActstoreError


class InvalidSetting(ActstoreError, ValueError):
    """A setting's value is invalid or missing; ``setting`` names the parameter."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting
        self.detail = message
