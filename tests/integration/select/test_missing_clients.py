"""A client package the interop paths import only when needed, missing: one line naming the extra to
install and a non-zero exit, nothing written.  Each case runs in a fresh interpreter whose import
system refuses the package (a ``sys.meta_path`` finder), as when it was never installed; the others
import as usual.  (``actstore import`` imports no client package: a TransformerLens cache or nnsight
saves arrive as tensors, vLLM's files through safetensors, which transformers itself requires.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"No module named {{name!r}} (blocked by the test)")
        return None
sys.meta_path.insert(0, Block())
"""


def run(blocked: set[str], body: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = BLOCK.format(blocked=sorted(blocked)) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def one_line(p: subprocess.CompletedProcess[str]) -> str:
    lines = [x for x in p.stderr.splitlines() + p.stdout.splitlines() if x.strip()]
    assert len(lines) == 1, p.stdout + p.stderr
    return lines[0]


def test_to_hf_dataset_without_datasets(tmp_path: Path, store_factory: object) -> None:
    """The SAELens export with datasets refused: one line naming the ``hf`` extra, no folder."""
    store = store_factory("llama", limit=2)  # type: ignore[operator]
    body = f"""
    import actstore
    from actstore.core.errors import MissingDependency, QueryError
    try:
        actstore.open({str(store)!r}).select().to_hf_dataset({str(tmp_path / "x")!r}, "resid", layers=[1])
    except QueryError as e:
        print(e)
        raise SystemExit(1)
    """
    p = run({"datasets"}, body, tmp_path)
    assert p.returncode == 1
    assert one_line(p) == "to_hf_dataset needs the datasets package: pip install 'actstore[hf]'"
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("blocked", ["transformer_lens"])
def test_activation_cache_without_transformer_lens_is_the_documented_dict(
    tmp_path: Path, store_factory: object, blocked: str
) -> None:
    """``to_activation_cache`` without transformer-lens: the hook-name dict (as documented), and its
    values are the store's rows; ``StoreModel`` (the cache's model) names the ``tlens`` extra."""
    store = store_factory("llama", limit=2)  # type: ignore[operator]
    body = f"""
    import numpy as np
    import actstore
    from actstore.query.select.tl_cache import StoreModel
    s = actstore.open({str(store)!r})
    sel = s.select()
    c = sel.to_activation_cache(kinds=["resid"], layers=[1])
    assert type(c) is dict, type(c)
    np.testing.assert_array_equal(c["blocks.1.hook_resid_pre"][:, 0].numpy(), sel.features("resid", layers=[1])[:, 0])
    try:
        StoreModel(s)
    except Exception as e:
        print(e)
        raise SystemExit(1)
    """
    p = run({blocked}, body, tmp_path)
    assert p.returncode == 1, p.stderr
    assert one_line(p) == "transformer_lens is not installed: pip install 'actstore[tlens]'"
