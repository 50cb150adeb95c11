"""sgl-sparsekv: retrieval-based sparse decoding for SGLang (algorithms and state, plain torch)."""

from sgl_sparsekv.config import ConfigError, SparseKVConfig

__all__ = ["ConfigError", "SparseKVConfig"]
__version__ = "0.1.0"
