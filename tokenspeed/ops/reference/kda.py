"""Plain-torch reference of Kimi Delta Attention (KDA), spec section 2.4.

KDA is a gated delta rule with a per-channel (key-dimension) decay. Per head the state
``S`` has shape ``[K, V]`` (FLA's convention) and every token does::

    S' = diag(exp(g_t)) S                 # decay acts on the key dimension (rows)
    nu = beta_t * (v_t - S'^T k_t)        # delta-rule residual, in R^V
    S  = S' + k_t nu^T
    o_t = S^T (scale * q_t)               # uses the updated state

Two forms of the same function are provided:

* :func:`kda_recurrent` runs that update token by token. It is the obviously-correct oracle
  and, called with one token per sequence, it is also the decode step.
* :func:`kda_chunk` splits each sequence into chunks of ``C`` tokens. Inside a chunk with
  cumulative log decay ``Gamma_i = sum_{j<=i} g_j`` the delta rule becomes a unit
  lower-triangular system ``(I + L) nu = diag(beta) (V - K_hat S_0)`` with
  ``L[i, j] = beta_i * sum_d k_i[d] k_j[d] exp(Gamma_i[d] - Gamma_j[d])`` (j < i), solved by
  forward substitution (the "WY" form: ``nu = U - W S_0`` with ``U = T V``, ``W = T K_hat``,
  ``T = (I + L)^-1 diag(beta)``). Outputs and the next chunk-start state follow in closed form.

Numerical trap: with the K3 gate (lower bound -5) ``Gamma`` reaches about -320 within a
64-token chunk. ``exp(-Gamma_j)`` then overflows fp32, so ``exp(Gamma_i) * exp(-Gamma_j)``
gives ``0 * inf = nan``. This module only forms pairwise differences ``Gamma_i - Gamma_j``
and masks them to ``i >= j`` (setting the rest to ``-inf``) *before* ``exp``, so every
exponent is <= 0 and every decay factor lies in ``[0, 1]``.

All math is fp32. Batches are flat variable-length: tokens of all sequences are concatenated
along the first dimension and ``cu_seqlens`` (``[N + 1]``, int64, starting at 0) delimits them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def kda_gate(
    f: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    lower_bound: float | None,
) -> Tensor:
    """Per-channel log-space decay ``g`` of KDA.

    Args:
        f: gate logits ``[T, H, K]`` (any float dtype).
        A_log: per-head log rate ``[H]`` (fp32).
        dt_bias: per-channel bias ``[H, K]`` (fp32).
        lower_bound: ``lambda`` of the bounded (K3) gate, e.g. ``-5.0``; ``None`` selects the
            unbounded (Kimi-Linear-48B) softplus gate.

    Returns:
        ``g`` ``[T, H, K]`` fp32, with
        ``g = lambda * sigmoid(exp(A_log[h]) * (f + dt_bias))`` when ``lower_bound`` is given,
        else ``g = -exp(A_log[h]) * softplus(f + dt_bias)``. Inputs are not mutated.
    """
    x = f.float() + dt_bias.float()
    rate = A_log.float().exp()[:, None]  # [H, 1], broadcasts over K
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """Return ``x / sqrt(sum(x**2, -1) + eps)`` over the last dimension, as fp32.

    Shape is preserved (``[..., D]``); ``x`` is not mutated.
    """
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor,
) -> None:
    """Validate shapes of the KDA inputs (see :func:`kda_recurrent`); raise ValueError."""
    T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != (T, H, K) or g.shape != (T, H, K):
        raise ValueError(f"q, k, g must share shape [T,H,K]; got {q.shape}, {k.shape}, {g.shape}")
    if v.shape != (T, H, V) or beta.shape != (T, H):
        raise ValueError(f"bad v {tuple(v.shape)} or beta {tuple(beta.shape)} for q {tuple(q.shape)}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor [N + 1]")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}; got {cu_seqlens.tolist()}")
    N = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [{N},{H},{K},{V}]; got {tuple(initial_state.shape)}")


def _initial_state(
    initial_state: Tensor | None, N: int, H: int, K: int, V: int, device: torch.device
) -> Tensor:
    """Fresh fp32 copy of ``initial_state`` (or zeros ``[N, H, K, V]``); never aliases the input."""
    if initial_state is None:
        return torch.zeros(N, H, K, V, dtype=torch.float32, device=device)
    return initial_state.to(device=device, dtype=torch.float32, copy=True)


def kda_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor,
) -> tuple[Tensor, Tensor]:
    """Token-by-token KDA over a flat variable-length batch (the oracle / decode form).

    Args:
        q, k: ``[T, H, K]``, already L2-normalised by the caller; ``q`` is multiplied by
            ``scale`` here.
        v: ``[T, H, V]``; its dtype is the output dtype.
        g: ``[T, H, K]`` fp32 log-space decay (``<= 0``).
        beta: ``[T, H]`` fp32, already passed through the sigmoid.
        scale: query scale, normally ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` state per sequence (any float dtype), or ``None`` for
            zeros. Not mutated.
        cu_seqlens: ``[N + 1]`` int64 offsets; zero-length sequences are allowed and pass
            their state through unchanged.

    Returns:
        ``(o, final_state)``: ``o`` ``[T, H, V]`` in ``v.dtype``; ``final_state``
        ``[N, H, K, V]`` fp32. All arithmetic is fp32.
    """
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    T, H, K = q.shape
    V = v.shape[-1]
    N = cu_seqlens.numel() - 1
    qf, kf, vf = q.float() * scale, k.float(), v.float()
    gf, bf = g.float(), beta.float()
    states = _initial_state(initial_state, N, H, K, V, q.device)
    o = torch.zeros(T, H, V, dtype=torch.float32, device=q.device)
    starts = cu_seqlens[:-1].to(q.device)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(q.device)
    # All sequences advance in lockstep: step j updates the j-th token of every sequence that has one.
    for j in range(int(lengths.max()) if N else 0):
        seqs = torch.nonzero(lengths > j).squeeze(1)  # [n] sequences with a token at step j
        t = starts[seqs] + j  # [n] their flat token index
        S = gf[t].exp()[..., None] * states[seqs]  # S' = diag(exp(g_t)) S, [n, H, K, V]
        pred = torch.einsum("nhkv,nhk->nhv", S, kf[t])  # S'^T k_t
        nu = bf[t][..., None] * (vf[t] - pred)
        S = S + kf[t][..., None] * nu[:, :, None, :]
        o[t] = torch.einsum("nhkv,nhk->nhv", S, qf[t])
        states[seqs] = S
    return o.to(v.dtype), states


def _masked_decay(gamma: Tensor) -> Tensor:
    """Pairwise decays ``D[h, i, j, :] = exp(Gamma_i - Gamma_j)`` for ``i >= j``, else 0.

    ``gamma``: ``[H, C, K]`` fp32 cumulative log decay of one chunk. Returns ``[H, C, C, K]``
    with entries in ``[0, 1]``. The exponent is masked to ``-inf`` before ``exp`` so that the
    (positive, possibly huge) upper-triangle differences never reach ``exp``.
    """
    C = gamma.shape[1]
    diff = gamma[:, :, None, :] - gamma[:, None, :, :]  # [H, i, j, K]
    causal = torch.ones(C, C, dtype=torch.bool, device=gamma.device).tril()
    return diff.masked_fill(~causal[None, :, :, None], float("-inf")).exp()


def _chunk_step(
    S0: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
) -> tuple[Tensor, Tensor]:
    """Advance one chunk of one sequence in closed (WY) form.

    Args:
        S0: chunk-start state ``[H, K, V]`` fp32.
        q: ``[H, C, K]`` fp32, already scaled; k: ``[H, C, K]``; v: ``[H, C, V]``;
        g: ``[H, C, K]`` log decay; beta: ``[H, C]``. All fp32, ``C >= 1`` (may be < chunk size).

    Returns:
        ``(o, S_C)``: outputs ``[H, C, V]`` and chunk-end state ``[H, K, V]``. Nothing is mutated.
    """
    C = q.shape[1]
    gamma = g.cumsum(dim=1)  # Gamma_i, [H, C, K], non-increasing, <= 0
    decay = _masked_decay(gamma)  # exp(Gamma_i - Gamma_j) for i >= j, [H, C, C, K]
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)

    # L[i, j] = beta_i * sum_d k_i k_j exp(Gamma_i - Gamma_j), strictly lower triangular.
    kk = torch.einsum("hid,hjd,hijd->hij", k, k, decay)
    L = beta[:, :, None] * kk * strict
    # Forward substitution: (I + L) [U | W] = diag(beta) [V | K_hat], K_hat_i = exp(Gamma_i) * k_i.
    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    rhs = beta[:, :, None] * torch.cat([v, gamma.exp() * k], dim=-1)
    UW = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
    U, W = UW.split([v.shape[-1], k.shape[-1]], dim=-1)
    nu = U - W @ S0  # [H, C, V]

    # o_i = S0^T (exp(Gamma_i) q_i) + sum_{j<=i} (q_i . exp(Gamma_i - Gamma_j) k_j) nu_j
    qk = torch.einsum("hid,hjd,hijd->hij", q, k, decay)
    o = (gamma.exp() * q) @ S0 + qk @ nu
    # S_C = diag(exp(Gamma_C)) S0 + sum_j (exp(Gamma_C - Gamma_j) k_j) nu_j^T
    k_to_end = decay[:, -1] * k  # [H, C, K]; row C-1 of decay is exp(Gamma_C - Gamma_j)
    S_C = gamma[:, -1].exp()[:, :, None] * S0 + k_to_end.transpose(1, 2) @ nu
    return o, S_C


def kda_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunked (WY / forward-substitution) KDA; the same function as :func:`kda_recurrent`.

    Arguments and returns are exactly those of :func:`kda_recurrent`, plus ``chunk_size``
    (``C >= 1``). Sequences of any length are accepted: each is split into chunks of ``C``
    tokens and its last chunk may be shorter; no padding is needed. Vectorised over heads;
    sequences and chunks are walked in order. fp32 throughout; inputs are not mutated.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    T, H, K = q.shape
    V = v.shape[-1]
    N = cu_seqlens.numel() - 1
    # Head-major fp32 views: [H, T, *].
    qh = (q.float() * scale).transpose(0, 1)
    kh, vh, gh = k.float().transpose(0, 1), v.float().transpose(0, 1), g.float().transpose(0, 1)
    bh = beta.float().transpose(0, 1)
    states = _initial_state(initial_state, N, H, K, V, q.device)
    o = torch.zeros(H, T, V, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for n in range(N):
        S = states[n]
        for start in range(bounds[n], bounds[n + 1], chunk_size):
            sl = slice(start, min(start + chunk_size, bounds[n + 1]))
            o[:, sl], S = _chunk_step(S, qh[:, sl], kh[:, sl], vh[:, sl], gh[:, sl], bh[:, sl])
        states[n] = S
    return o.transpose(0, 1).to(v.dtype), states
