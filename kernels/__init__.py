"""Triton kernels, each with a torch twin it is tested against (installed as sgl_sparsekv.kernels)."""
