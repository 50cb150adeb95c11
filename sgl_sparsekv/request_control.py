"""Per-request control: a request decodes densely, or sparsely at a budget of its own.

A client asks through SGLang's per-request ``custom_params`` (``/generate``'s ``sampling_params``, or
``extra_body={"custom_params": ...}`` with the OpenAI API):

    {"sparse_kv": "off"}                      this request attends to its whole context at every step
    {"sparse_kv": {"token_budget": 512}}      this request reads at most 512 tokens a step (<= the server's budget)

A request without the key decodes as the server is configured. The server checks the value when the request
arrives (``patches/plugin.py`` hooks ``SamplingParams.verify``), so a bad one is answered with one line and never
reaches a decode step. The budget cannot exceed the server's: every step's token lists are sized for it, inside the
captured CUDA graphs, which serve every request whatever it asked for.
"""

from __future__ import annotations

from sgl_sparsekv.config import SparseKVConfig

KEY = "sparse_kv"
OFF = 0   # the budget of a request that asked for dense decoding


def requested(custom_params) -> object:
    """The raw ``sparse_kv`` value of a request's custom_params (None without one)."""
    return custom_params.get(KEY) if isinstance(custom_params, dict) else None


def parse(value, cfg: SparseKVConfig) -> int | None:
    """A request's budget from its ``sparse_kv`` value: None (the server's), ``OFF`` (dense), or its own token
    budget. Raises ValueError with one line for a value the server cannot honour."""
    if value is None:
        return None
    if value == "off":
        return OFF
    where = f"custom_params {KEY!r}"
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected \"off\" or {{\"token_budget\": N}}, got {value!r}")
    unknown = sorted(set(value) - {"token_budget"})
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (the one key is 'token_budget')")
    budget = value.get("token_budget")
    if not cfg.enabled:
        raise ValueError(f"{where}: this server decodes densely (--sparse-kv off); only \"off\" is accepted")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"{where}: token_budget must be an integer, got {budget!r}")
    floor = cfg.sink_tokens + cfg.recent_window
    if not floor < budget <= cfg.token_budget:
        raise ValueError(f"{where}: token_budget {budget} is outside ({floor}, {cfg.token_budget}]: above the sink "
                         f"and recent window ({floor} tokens), at most the server's budget")
    return None if budget == cfg.token_budget else budget
