"""Hybrid heads (LycheeDecode): which KV heads of each sparse layer retrieve and which reuse.

A **retrieval** head selects its own tokens (lychee's cluster retrieval). A **sparse** head attends to the token
set that the same KV head used in the previous layer and passes it on, so a chain of sparse heads inherits the
set of the last retrieval head above it. The first sparse layer retrieves with every head.

Config key ``head_roles`` (lychee):
- ``"all-retrieval"`` (default): every head retrieves;
- ``"staggered-<share>"``, e.g. ``"staggered-0.25"``: no calibration; about ``share`` of the heads of the sparse
  layers retrieve, each head every few layers with offsets that differ per head, for any model;
- the name of a shipped role map (``configs/head_roles/<name>.json``) or a path to one.

A role map file::

    {"model": "...", "num_layers": 24, "num_kv_heads": 2, "dense_layers": 2,
     "layers": ["dense", "dense", "RR", "SR", ...], "made_by": "how it was made"}

one entry per model layer: ``"dense"`` for the dense layers, else one letter per KV head, ``R`` (retrieval) or
``S`` (sparse). It is checked against the served model at startup; a mismatch is a one-line ConfigError.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from sgl_sparsekv.errors import ConfigError

ALL = "all-retrieval"
# configs/ is installed as the package sgl_sparsekv.configs (pyproject's package-dir); a checkout run without
# installing finds it beside the package
_CONFIGS = importlib.util.find_spec("sgl_sparsekv.configs")
SHIPPED = (Path(_CONFIGS.submodule_search_locations[0]) if _CONFIGS else
           Path(__file__).resolve().parent.parent / "configs") / "head_roles"
_STAGGERED = re.compile(r"staggered-(\d*\.?\d+)$")


def _error(msg: str):
    return ConfigError(f"sparse-kv config: head_roles: {msg}")


def staggered_roles(num_layers: int, heads: int, first: int, count: int) -> list[list[bool]]:
    """About ``count`` retrieval heads over layers ``[first, num_layers)``: the first sparse layer retrieves with
    every head, then each head every ``period`` layers, heads offset from one another, so no chain of reuse is
    longer than the period and every layer keeps some retrieval heads. Rows of the dense layers are all False."""
    period = max(1, round((num_layers - first) * heads / max(1, count)))
    roles = [[False] * heads for _ in range(num_layers)]
    roles[first] = [True] * heads
    for l in range(first + 1, num_layers):
        roles[l] = [(l - first + h * period // heads) % period == 0 for h in range(heads)]
    return roles


def to_strings(roles, first: int) -> list[str]:
    """Per layer: "dense" below ``first``, else one letter per KV head (R or S), the role map's ``layers``."""
    return ["dense" if l < first else "".join("R" if r else "S" for r in row) for l, row in enumerate(roles)]


def _map_path(spec: str) -> Path:
    for p in (Path(spec), SHIPPED / f"{spec}.json"):
        if p.is_file():
            return p
    names = sorted(p.stem for p in SHIPPED.glob("*.json"))
    raise _error(f"{spec!r} is not 'all-retrieval', 'staggered-<share>', a shipped map ({', '.join(names)}) "
                 "or an existing file")


def load_map(spec: str) -> dict:
    """A role map file, its ``layers`` checked for form (the model shape is checked by :func:`resolve`)."""
    path = _map_path(spec)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise _error(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list) or not layers or not all(isinstance(x, str) for x in layers):
        raise _error(f"{path} needs a 'layers' list of strings")
    sparse = [x for x in layers if x != "dense"]
    if not sparse or any(set(x) - {"R", "S"} for x in sparse) or len({len(x) for x in sparse}) != 1:
        raise _error(f"{path}: every layer must be 'dense' or one R/S letter per KV head, all of one length")
    first = layers.index(sparse[0])
    if any(x == "dense" for x in layers[first:]) or set(layers[first]) != {"R"}:
        raise _error(f"{path}: dense layers must come first and the first sparse layer must be all R")
    return data


def validate(spec: str) -> None:
    """Config-time check of the value's form (and, for a map, of the file)."""
    if spec == ALL:
        return
    m = _STAGGERED.match(spec)
    if m:
        if not 0 < float(m.group(1)) <= 1:
            raise _error(f"{spec!r}: the share must be in (0, 1]")
        return
    load_map(spec)


def resolve(spec: str, num_layers: int, num_kv_heads: int, dense_layers: int,
            heads: range | None = None) -> list[list[int]] | None:
    """Per sparse layer, the KV heads that retrieve; None when every head does. Raises a one-line ConfigError
    when a map does not fit the model (layers, ``num_kv_heads`` of the whole model, dense layers). ``heads``: the
    model's KV heads that this tensor-parallel rank holds (all by default); the result counts from its first."""
    if spec == ALL:
        return None
    m = _STAGGERED.match(spec)
    if m:
        sparse_heads = (num_layers - dense_layers) * num_kv_heads
        count = max(num_kv_heads, round(float(m.group(1)) * sparse_heads))
        rows = staggered_roles(num_layers, num_kv_heads, dense_layers, count)[dense_layers:]
    else:
        data = load_map(spec)
        layers = data["layers"]
        dense = sum(x == "dense" for x in layers)
        width = len(layers[dense])
        model = data.get("model", "?")
        if len(layers) != num_layers or width != num_kv_heads or dense != dense_layers:
            raise _error(f"{spec!r} (made for {model}: {len(layers)} layers, {width} KV heads, {dense} dense) "
                         f"does not fit this model ({num_layers} layers, {num_kv_heads} KV heads, "
                         f"dense_layers {dense_layers})")
        rows = [[c == "R" for c in x] for x in layers[dense:]]
    heads = range(num_kv_heads) if heads is None else heads
    return [[h - heads.start for h in heads if row[h]] for row in rows]
