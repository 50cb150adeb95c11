"""bench/head_roles.py: role choices and chained reuse on synthetic attention (brute force, no model)."""

import numpy as np
import torch

from bench.attention_recall import mask_metrics, summarize
from bench.head_roles import attention_weights, calibrated_roles, chained_metrics, greedy_roles, staggered_roles

L, FIRST, H, G, D, T, QUERIES = 8, 2, 3, 2, 16, 60, (56, 57, 58, 59)


def synthetic(seed=0):
    gen = torch.Generator().manual_seed(seed)
    layers = [(torch.randn(H * G, T, D, generator=gen), torch.randn(H, T, D, generator=gen),
               torch.randn(H, T, D, generator=gen)) for _ in range(L)]
    masks = {(l, t): torch.rand(H, t + 1, generator=gen) < 0.3 for l in range(FIRST, L) for t in QUERIES}
    return layers, masks


def test_greedy_roles_extremes_and_bisected_count():
    layers, masks = synthetic()
    w = attention_weights(layers, masks, FIRST)
    assert greedy_roles(w, masks, FIRST, float("-inf"))[FIRST:].all()
    only_first = greedy_roles(w, masks, FIRST, float("inf"))
    assert only_first[FIRST].all() and not only_first[FIRST + 1:].any() and not only_first[:FIRST].any()
    for count in (6, 10):
        assert abs(int(calibrated_roles(w, masks, FIRST, count)[FIRST:].sum()) - count) <= H


def test_staggered_roles_bound_every_chain():
    roles = staggered_roles((L, H), FIRST, 8)
    period = round((L - FIRST) * H / 8)
    for h in range(H):
        at = np.flatnonzero(roles[:, h])
        assert at[0] == FIRST and np.diff(at).max() <= period


def test_chained_metrics_follow_the_parent():
    layers, masks = synthetic(1)
    everyone = np.zeros((L, H), dtype=bool)
    everyone[FIRST:] = True
    own = summarize({k: mask_metrics(layers[k[0]], k[1], m, 8) for k, m in masks.items()})
    assert chained_metrics(layers, masks, everyone, 8, FIRST)["mass_recall"] == own["mass_recall"]
    # nobody retrieves after the first sparse layer: every layer attends to the first layer's selection
    first_only = np.zeros((L, H), dtype=bool)
    first_only[FIRST] = True
    inherited = summarize({(l, t): mask_metrics(layers[l], t, masks[(FIRST, t)], 8)
                           for l in range(FIRST, L) for t in QUERIES})
    assert chained_metrics(layers, masks, first_only, 8, FIRST)["mass_recall"] == inherited["mass_recall"]
