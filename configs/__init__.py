"""Shipped configs (JSON), installed as sgl_sparsekv.configs so a role map is found by name."""
