"""SparseKVConfig: one typed, validated object for every sparse-decoding knob.

Defaults follow the LycheeCluster paper (budget 1024, chunks of 8-16 tokens, fine clusters of
2 chunks on average, at most 64 coarse units, 10 spherical k-means iterations, 16 sink tokens,
first 2 layers dense) and Quest (16-token pages). A config is built from the method named by
``--sparse-kv`` plus optional overrides (a JSON file or a JSON string); anything unknown,
mistyped or impossible raises :class:`ConfigError` with one line that names the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from sgl_sparsekv import head_roles
from sgl_sparsekv.errors import ConfigError

METHODS = ("off", "lychee", "quest")
# a candidate list is scored in one program's registers: up to this many times the budget
MAX_RERANK = 8
_TYPES = {"int": int, "float": (int, float), "str": str, "bool": bool}


@dataclass(frozen=True)
class SparseKVConfig:
    method: str = "off"
    # Tokens attended per decode step and KV head, sink and recent window included.
    token_budget: int = 1024
    # The first `sink_tokens` and the last `recent_window` tokens are always attended.
    sink_tokens: int = 16
    recent_window: int = 64
    # Layers [0, dense_layers) always attend densely.
    dense_layers: int = 2
    # How query heads of one GQA group agree on one selection: "max" takes the largest
    # bound over the group's heads, "mean" scores with the group's mean query.
    gqa_reduce: str = "max"
    # GPU index pools hold indexes over this many times the KV slots (requests that adopt one cached prefix
    # share one copy of its index); charged to SGLang's memory plan per KV slot.
    index_pool_scale: float = 1.0
    # --- lychee (quest fixes these: quest_policy) ---
    # "structure": boundary-aware cuts; "fixed": cuts every chunk_max tokens (ablation).
    chunking: str = "structure"
    chunk_min: int = 8
    chunk_max: int = 16
    # Average chunks per fine cluster. The paper's default is 2; its sensitivity analysis (Appendix E) and the GPU
    # harness here find the most recall at 1 (221 of 500 answers at 16K against 213, dense 224), which doubles the
    # fine pool (index memory 8.0% of the KV instead of 4.1% for Llama-3.1-8B) and costs a few % of serving speed.
    fine_cluster_size: float = 1.0
    max_coarse: int = 64
    kmeans_iters: int = 10
    # Coarse units are expanded in bound order until their fine clusters hold
    # `coarse_expand` x the remaining budget in tokens (see sgl_sparsekv/select.py). At 30K on real Qwen weights
    # 32 answered dense's 195 of 500 where 16 answered 179; selection per sparse layer at batch 16 costs 0.131 ms
    # instead of 0.105 (H200, README "Fidelity" and bench/results/selection_breakdown_expand.json).
    coarse_expand: float = 32.0
    # ... and at least this many tokens, so a small budget prunes no more of the prompt than budget 1024 does
    # (32 x 944 = 30208 tokens). Without it, budget 256 expanded 32 x 176 = 5.6K tokens, a fifth of a 30K prompt,
    # and answered 87 of 340 at 30K where Quest answered 109 (README, the 30K sweep). 0: no floor.
    coarse_expand_min: int = 30000
    # Coarse units and fine clusters are ranked by q.mu + radius_weight |q| r: 1 is the upper bound of
    # LycheeCluster, under which wide clusters of filler outrank the tight one holding a needle; 0.25 answered
    # 213 of 500 long-context samples where 1 answered 171 (README, fidelity on the GPU).
    radius_weight: float = 0.25
    # What fine clusters are ranked by: "ball", their centroid and radius over unit chunk keys (LycheeCluster);
    # "box", the per-dimension min and max of their tokens' raw keys, q.c + radius_weight |q|.w (center c,
    # half-width w; radius_weight 1 is Quest's bound), which keeps the single tokens a chunk's mean key averages
    # away. A box (bf16) costs 4 x head_dim bytes per fine cluster and KV head beside the centroid's head_dim.
    fine_bound: str = "ball"
    # Hybrid heads (LycheeDecode): "all-retrieval", "staggered-<share>", or a role map (sgl_sparsekv/head_roles.py)
    # naming the KV heads that select their own tokens; the others reuse the previous layer's selection.
    head_roles: str = "all-retrieval"
    # Two-stage selection: the cut picks rerank_factor x the budget past the sink and the recent window as candidate
    # tokens, whose keys are scored exactly; the budget's best of them by the query group's attention are attended.
    # Values read stay the budget's, keys read grow by the factor. 1: off.
    rerank_factor: int = 1
    # A request selects its tokens every `select_every` decode steps and reuses them in between, attending to the
    # tokens decoded since beside them (RACC: adjacent steps attend alike). 1: every step.
    select_every: int = 1
    # A decode step attends to the token lists its request selected at the step before plus the token decoded
    # since, and selects the next step's lists with its own query beside the attention (a second CUDA stream in
    # the same graph), so selection leaves the step's critical path (RACC: adjacent steps attend alike). With
    # select_every k, every kth step selects so, for the k steps after it; with host_tier, its loads go beside too.
    select_ahead: bool = False
    # Every this many sparse decode steps (0: never), the live recall audit measures, for a few rows past their
    # budget, the share of dense attention's mass the step's selection kept (sgl_sparsekv/recall_audit.py); that
    # step runs outside CUDA graphs.
    recall_audit_every: int = 0
    # The host KV tier (sgl_sparsekv/host_tier.py, docs/HOST_TIER.md): the sparse layers' KV of every token lives
    # in a host pool, and the device keeps, per request, the last ``host_window`` tokens of those layers (SGLang's
    # hybrid sliding-window pools: ``--swa-full-tokens-ratio`` sizes that device pool against the full one).
    # On a GPU the host pool is registered host memory that the kernels read over the bus.
    host_tier: bool = False
    host_window: int = 1024
    # The host pool's size in GiB (0: 90% of the host memory available at startup beyond what the rest of the server
    # keeps, host_tier.HOST_RESERVE_BYTES). SGLang's memory plan gives the KV pool no more slots than the sparse
    # layers' KV of every slot can fill here.
    host_memory_gb: float = 0.0
    # --- quest ---
    page_size: int = 16

    # Keys that only one method reads; giving them to the other is an error, not a no-op.
    _ONLY = {
        "lychee": ("chunking", "chunk_min", "chunk_max", "fine_cluster_size", "max_coarse", "kmeans_iters",
                   "coarse_expand", "coarse_expand_min", "radius_weight", "fine_bound", "head_roles",
                   "rerank_factor", "select_every", "select_ahead"),
        "quest": ("page_size",),
    }

    def __post_init__(self):
        if self.method == "quest":
            for key, value in self.quest_policy(self.page_size).items():
                object.__setattr__(self, key, value)
        self.validate()

    @staticmethod
    def quest_policy(page_size: int) -> dict[str, Any]:
        """Quest as a selection policy of the one decode lifecycle: the prompt is cut into fixed pages, each page is
        its own fine cluster ranked by its key box with Quest's bound (``sum_i max(q_i lo_i, q_i hi_i)``, a box
        bound with radius_weight 1), and the coarse level prunes nothing, so the cut takes the best
        ``budget // page_size`` pages, ties by lower index, as Quest's top-k does. Pages cut at decode are grafted
        into the nearest page's cluster, as lychee's chunks are."""
        return {"chunking": "fixed", "chunk_min": page_size, "chunk_max": page_size, "fine_cluster_size": 1.0,
                "fine_bound": "box", "radius_weight": 1.0, "coarse_expand": float("inf"), "coarse_expand_min": 0}

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def unit_max(self) -> int:
        """Largest retrieval unit (chunk or page) in tokens."""
        return self.chunk_max

    def expansion(self, budget):
        """The coarse expansion factor for a cut of ``budget`` retrieved tokens (an int, or a tensor of one budget
        per head): ``coarse_expand``, raised so the expanded units hold at least ``coarse_expand_min`` tokens."""
        if hasattr(budget, "clamp"):
            return (self.coarse_expand_min / budget.clamp(min=1)).clamp(min=self.coarse_expand)
        return max(self.coarse_expand, self.coarse_expand_min / max(budget, 1))

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"--sparse-kv: unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        for f in dataclasses.fields(self):
            v, want = getattr(self, f.name), _TYPES[f.type]
            if isinstance(v, bool) != (want is bool) or not isinstance(v, want):
                name = f.type
                raise ConfigError(f"sparse-kv config: key {f.name!r} must be {name}, got {type(v).__name__} {v!r}")
        positive = ("token_budget", "chunk_min", "chunk_max", "fine_cluster_size", "max_coarse",
                    "kmeans_iters", "page_size", "coarse_expand", "index_pool_scale", "select_every")
        for k in positive:
            if getattr(self, k) <= 0:
                raise ConfigError(f"sparse-kv config: key {k!r} must be > 0, got {getattr(self, k)}")
        for k in ("sink_tokens", "recent_window", "dense_layers", "coarse_expand_min", "recall_audit_every",
                  "host_memory_gb"):
            if getattr(self, k) < 0:
                raise ConfigError(f"sparse-kv config: key {k!r} must be >= 0, got {getattr(self, k)}")
        if self.chunk_min > self.chunk_max:
            raise ConfigError(f"sparse-kv config: chunk_min ({self.chunk_min}) > chunk_max ({self.chunk_max})")
        if self.fine_bound not in ("ball", "box"):
            raise ConfigError(f"sparse-kv config: key 'fine_bound' must be 'ball' or 'box', got {self.fine_bound!r}")
        if self.chunking not in ("structure", "fixed"):
            raise ConfigError(f"sparse-kv config: key 'chunking' must be 'structure' or 'fixed', got {self.chunking!r}")
        if self.gqa_reduce not in ("max", "mean"):
            raise ConfigError(f"sparse-kv config: key 'gqa_reduce' must be 'max' or 'mean', got {self.gqa_reduce!r}")
        if self.coarse_expand < 1:
            raise ConfigError(f"sparse-kv config: key 'coarse_expand' must be >= 1, got {self.coarse_expand}")
        if not 1 <= self.rerank_factor <= MAX_RERANK:
            raise ConfigError(f"sparse-kv config: key 'rerank_factor' must be in [1, {MAX_RERANK}], got "
                              f"{self.rerank_factor}")
        if not 0 <= self.radius_weight <= 1:
            raise ConfigError(f"sparse-kv config: key 'radius_weight' must be in [0, 1], got {self.radius_weight}")
        if self.method == "lychee":
            head_roles.validate(self.head_roles)
            if self.select_every > 1 and (self.head_roles != "all-retrieval" or self.rerank_factor > 1):
                raise ConfigError("sparse-kv config: select_every > 1 needs head_roles 'all-retrieval' and "
                                  "rerank_factor 1 (reused token lists are kept per layer for retrieval heads only)")
            if self.select_ahead and (self.head_roles != "all-retrieval" or self.rerank_factor > 1):
                raise ConfigError("sparse-kv config: select_ahead needs head_roles 'all-retrieval' and rerank_factor 1")
        if self.enabled:
            # The recent window must hold the not-yet-indexed buffer (< one unit) and the budget must
            # leave room for at least one retrieved unit beside the sink and the window.
            if self.recent_window < self.unit_max:
                raise ConfigError(f"sparse-kv config: recent_window ({self.recent_window}) must be >= the largest "
                                  f"chunk/page ({self.unit_max}) so unindexed tokens are always attended")
            need = self.sink_tokens + self.recent_window + self.unit_max
            if self.token_budget < need:
                raise ConfigError(f"sparse-kv config: token_budget ({self.token_budget}) must be >= sink_tokens + "
                                  f"recent_window + one chunk/page = {need}")
        if self.host_memory_gb and not self.host_tier:
            raise ConfigError("sparse-kv config: host_memory_gb sizes the host tier's pool; it needs host_tier true")
        if self.host_tier:
            # SGLang's hybrid pools need a full layer; the window holds the tokens not yet indexed
            if self.dense_layers < 1:
                raise ConfigError("sparse-kv config: host_tier needs dense_layers >= 1 (the dense layers hold every "
                                  "token's KV on the device)")
            shared = [k for k, on in (("rerank_factor > 1", self.rerank_factor > 1),
                                       ("head_roles", self.head_roles != "all-retrieval")) if on]
            if shared:   # each reads a layer's token lists against another buffer than its hot rows
                raise ConfigError(f"sparse-kv config: host_tier does not run with {', '.join(shared)} yet")
            if self.select_every > self.token_budget - self.recent_window:   # a kept list's window stays in the ring
                raise ConfigError(f"sparse-kv config: host_tier needs select_every ({self.select_every}) <= "
                                  f"token_budget - recent_window = {self.token_budget - self.recent_window}")
            if self.sink_tokens > self.unit_max:   # the sink is one more hot chunk
                raise ConfigError(f"sparse-kv config: host_tier needs sink_tokens ({self.sink_tokens}) <= the largest "
                                  f"chunk/page ({self.unit_max})")
            if self.host_window < self.recent_window + self.unit_max:
                raise ConfigError(f"sparse-kv config: host_window ({self.host_window}) must be >= recent_window + "
                                  f"one chunk/page = {self.recent_window + self.unit_max}")

    # ---------------------------------------------------------------- building
    @classmethod
    def from_method(cls, method: str, overrides: str | dict | None = None) -> "SparseKVConfig":
        """``--sparse-kv METHOD [--sparse-kv-config FILE_OR_JSON]`` -> a validated config."""
        if method not in METHODS:
            raise ConfigError(f"--sparse-kv: unknown method {method!r}; choose one of {', '.join(METHODS)}")
        data = load_overrides(overrides)
        if method == "off":
            if data:
                raise ConfigError("--sparse-kv-config was given but --sparse-kv is off; add --sparse-kv lychee or quest")
            return cls(method="off")
        names = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key == "method":
                if data[key] != method:
                    raise ConfigError(f"sparse-kv config: key 'method' is {data[key]!r} but --sparse-kv is {method!r}")
                continue
            if key not in names:
                raise ConfigError(f"sparse-kv config: unknown key {key!r}")
            for other, keys in cls._ONLY.items():
                if other != method and key in keys:
                    raise ConfigError(f"sparse-kv config: key {key!r} applies to --sparse-kv {other}, not {method}")
        data.pop("method", None)
        return cls(method=method, **data)

    def to_dict(self) -> dict[str, Any]:
        if not self.enabled:
            return {"method": "off"}
        keys = [f.name for f in dataclasses.fields(self)]
        for other, only in self._ONLY.items():
            if other != self.method:
                keys = [k for k in keys if k not in only]
        return {k: getattr(self, k) for k in keys}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SparseKVConfig":
        return cls(**data)


def load_overrides(src: str | dict | None) -> dict[str, Any]:
    """A JSON object given inline, as a path to a JSON file, or already parsed."""
    if src is None or src == "":
        return {}
    if isinstance(src, dict):
        return dict(src)
    text = src.strip()
    if not text.startswith("{"):
        if not os.path.isfile(text):
            raise ConfigError(f"--sparse-kv-config: {text!r} is neither a JSON object nor an existing file")
        with open(text) as f:
            text = f.read()
        where = src
    else:
        where = "inline JSON"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--sparse-kv-config: {where} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--sparse-kv-config: {where} must hold a JSON object, got {type(data).__name__}")
    return data
