"""The README's Python snippets run as a newcomer would paste them, each in a fresh interpreter.
The two that load SmolLM2 (prefilling its 2,800-token document twice, ~25 s here; decoding 1,024
tokens under a window) are compiled, not run: the same calls run in test_equivalence_smollm2.py,
the demo and test_engine_features_smollm2.py."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO

SNIPPETS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)


def test_every_readme_snippet_runs(tmp_path):
    assert len(SNIPPETS) >= 4
    ran = 0
    for i, code in enumerate(SNIPPETS):
        compile(code, f"README.md snippet {i}", "exec")
        if "load_model()" in code:
            continue
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                                timeout=300)
        assert result.returncode == 0, f"README snippet {i} failed:\n{code}\n{result.stderr[-2000:]}"
        ran += 1
    compiled_only = sum("load_model()" in code for code in SNIPPETS)
    assert ran == len(SNIPPETS) - compiled_only and compiled_only <= 2
