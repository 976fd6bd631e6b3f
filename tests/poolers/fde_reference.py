"""A literal reading of the MUVERA FDE definition (Dhulipala et al., NeurIPS 2024, arXiv
2405.19504, section 3), one partition and one point at a time, no vectorisation: the yardstick
``poolers/fde.py`` is checked against (and that bench/fde_libraries.py checks libraries with).

``gs[r]`` are repetition r's SimHash hyperplanes ``[k_sim, d]``; ``ss[r]`` its +-1 projection
matrix ``[d_proj, d]`` (psi(x) = S x / sqrt(d_proj)). Partition k of a point is the number whose
bit i is ``<g_i, x> > 0``.
"""
import numpy as np


def phi(g, x):
    """SimHash partition: the sign bits of <g_i, x>, read as a binary number (bit 0 = g_0)."""
    return sum(1 << i for i in range(len(g)) if g[i] @ x > 0)


def fde_literal(points, role, gs, ss, fill_empty=True):
    """The FDE of ``points`` (``[n, d]``) as ``role``; an empty document partition takes the
    earliest point at minimal Hamming distance."""
    out = []
    for g, s in zip(gs, ss):
        k_sim, dim_proj = len(g), len(s)
        parts = [phi(g, p) for p in points]
        for k in range(2 ** k_sim):
            members = [p for p, c in zip(points, parts) if c == k]
            if role == "query":
                vec = np.sum(members, axis=0) if members else np.zeros(points.shape[1])
            elif members:
                vec = np.mean(members, axis=0)
            elif fill_empty:
                ham = [bin(c ^ k).count("1") for c in parts]
                vec = points[int(np.argmin(ham))]
            else:
                vec = np.zeros(points.shape[1])
            out.append(s @ vec / np.sqrt(dim_proj))
    return np.concatenate(out)


def matches_definition(got, points, role, gs, ss, tol=1e-6):
    """True if ``got`` is a valid FDE of ``points`` under the definition, where an empty document
    partition may hold any point at minimal Hamming distance (the paper leaves ties open)."""
    pos = 0
    for g, s in zip(gs, ss):
        k_sim, dim_proj = len(g), len(s)
        parts = [phi(g, p) for p in points]
        for k in range(2 ** k_sim):
            blk = got[pos:pos + dim_proj]; pos += dim_proj
            members = [p for p, c in zip(points, parts) if c == k]
            if role == "query":
                allowed = [np.sum(members, axis=0) if members else np.zeros(points.shape[1])]
            elif members:
                allowed = [np.mean(members, axis=0)]
            else:
                ham = np.array([bin(c ^ k).count("1") for c in parts])
                allowed = [points[j] for j in np.flatnonzero(ham == ham.min())]
            if not any(np.abs(blk - s @ a / np.sqrt(dim_proj)).max() < tol for a in allowed):
                return False
    return pos == len(got)
