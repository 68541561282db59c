"""Command-line arguments fixed up before Hydra parses them.

Trees are written T_K_N (`eval.trees=[5_1_6,8_2_16]`), but Hydra's override grammar, like YAML,
reads `5_1_6` as the integer 516 (underscores separate digits). Quoting the items keeps them text.
"""
from __future__ import annotations

import re

_TREE_OVERRIDE = re.compile(r"^(\+{0,2}[\w.]*trees=)(.*)$")
_TREE = re.compile(r"^\d+_\d+_\d+$")


def quote_trees(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        m = _TREE_OVERRIDE.match(arg)
        if m:
            value = m.group(2)
            bracketed = value.startswith("[") and value.endswith("]")
            items = [s.strip() for s in (value[1:-1] if bracketed else value).split(",") if s.strip()]
            if items and all(_TREE.match(s) for s in items):
                quoted = ",".join(f"'{s}'" for s in items)
                arg = f"{m.group(1)}[{quoted}]" if bracketed else f"{m.group(1)}{quoted}"
        out.append(arg)
    return out
