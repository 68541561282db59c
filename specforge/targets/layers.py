"""The one check of aux layer ids: the decoder layers whose outputs the draft reads (docs/contract.md §2).

Id L is the output of decoder layer L. Every place that takes such ids (the target config, the
extractors, the engine, a checkpoint's eagle_config, SGLang's launch flags) checks them here, each
with its own field name and bounds. Imports neither torch nor transformers.
"""
from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

from specforge.errors import InvalidInput


def check_aux_layer_ids(
    ids,
    num_layers: int | None = None,
    *,
    what: str,
    count: int | None = None,
    ascending: bool = True,
    min_id: int | None = 0,
    max_id: int | None = None,
    why_min: str | None = None,
    why_max: str | None = None,
    hint: str = "",
) -> list:
    """`ids` as a list, or a ValueError that names `what` (the field) and the allowed range.

    - `count`: exactly this many ids (None: any number, none included).
    - `ascending`: distinct and ascending (False: only the range is checked).
    - `num_layers`: ids must be < num_layers (None: no upper bound from the model).
    - `min_id`: the lowest id allowed (None: no lower bound).
    - `max_id`: the highest id allowed, when tighter than num_layers - 1.
    - `why_min` / `why_max`: a tighter bound with its reason, checked after everything else and
      reported as `aux layer id X: <why>; the ids must be >= min_id` (or <= max_id). Without a
      reason, the bound is part of the range of the main check.
    - `hint`: appended to the main message.
    """
    lo = min_id
    hi = None if num_layers is None else num_layers - 1
    if max_id is not None:
        hi = max_id if hi is None else min(hi, max_id)
    if lo is None and hi is None:
        allowed = ""
    elif hi is None:
        allowed = f" >= {lo}"
    elif lo is None:
        allowed = f" <= {hi}"
    else:
        allowed = f" in [{lo}, {hi + 1})"
    rule = f"{count} " if count is not None else ""
    rule += "distinct ascending ids" if ascending else "ids"
    if (isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence)
            or not all(isinstance(i, Integral) for i in ids)):
        raise InvalidInput(f"{what}: {ids!r} must be a list of {rule}{allowed}{hint}")
    vals = list(ids)

    # The main check: what every site states in one sentence. Reasoned bounds come after it.
    base_lo = 0 if min_id is not None and why_min is not None else min_id
    base_hi = None if num_layers is None else num_layers - 1
    if max_id is not None and why_max is None:
        base_hi = max_id if base_hi is None else min(base_hi, max_id)
    bad = (
        (count is not None and len(vals) != count)
        or (ascending and sorted(set(vals)) != vals)
        or (base_lo is not None and any(i < base_lo for i in vals))
        or (base_hi is not None and any(i > base_hi for i in vals))
    )
    if bad:
        raise InvalidInput(f"{what}: {vals} must be {rule}{allowed}{hint}")
    if why_min is not None and min_id is not None:
        low = [i for i in vals if i < min_id]
        if low:
            raise InvalidInput(f"{what}: {vals}: aux layer id {min(low)}: {why_min}; the ids must be >= {min_id}")
    if why_max is not None and max_id is not None:
        high = [i for i in vals if i > max_id]
        if high:
            raise InvalidInput(f"{what}: {vals}: aux layer id {max(high)}: {why_max}; the ids must be <= {max_id}")
    return vals
