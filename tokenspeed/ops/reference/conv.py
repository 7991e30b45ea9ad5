"""Plain-torch reference of KDA's short causal depthwise conv1d with a carried state.

Spec section 2.4: for channel ``c`` at time ``t``::

    y_t[c] = act( sum_{j=0}^{W-1} weight[c, j] * x_{t-(W-1)+j}[c] )

so ``weight[:, W-1]`` multiplies the current token (PyTorch cross-correlation with left
padding ``W-1``). Inputs before a sequence's first new token come from its conv state, which
holds the last ``W-1`` *pre-conv* inputs (column ``W-2`` is the most recent). A fresh
sequence has a zero state, which reproduces zero left padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_ACTIVATIONS = ("silu", None)


def _conv_one_sequence(history: Tensor, weight: Tensor) -> Tensor:
    """Valid cross-correlation of ``history`` ``[W-1+L, C]`` with ``weight`` ``[C, W]``.

    Both fp32. Returns the pre-activation outputs ``[L, C]`` for the last ``L`` positions.
    """
    W = weight.shape[1]
    windows = history.unfold(0, W, 1)  # [L, C, W]; windows[t, c, j] = history[t + j, c]
    return (windows * weight).sum(-1)


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    conv_state: Tensor,
    state_indices: Tensor,
    cu_seqlens: Tensor,
    activation: str | None = "silu",
    *,
    out: Tensor | None = None,
) -> Tensor:
    """Causal depthwise conv1d over a flat variable-length batch, carrying per-slot state.

    Args:
        x: new tokens ``[T, C]``, all sequences concatenated.
        weight: ``[C, W]`` (fp32); ``weight[:, W-1]`` multiplies the current token. No bias.
        conv_state: state pool ``[S, C, W-1]``; slot ``state_indices[n]`` holds the ``W-1``
            inputs preceding sequence ``n``'s first new token (column ``W-2`` most recent).
        state_indices: ``[N]`` int64 slot per sequence; slots must be distinct.
        cu_seqlens: ``[N + 1]`` int64 offsets into ``x`` (starting at 0, ending at ``T``).
        activation: ``"silu"`` or ``None``; anything else raises ``ValueError``.
        out: optional destination, ``[T, C]`` or ``[T, G, C // G]`` (any strides) in ``x.dtype``; ``y`` is
            copied into it (viewed as its shape) and ``out`` is returned.

    Returns:
        ``y`` ``[T, C]`` in ``x.dtype``, computed in fp32.

    Mutates:
        ``conv_state[state_indices[n]]`` for every sequence with at least one token, in place:
        it becomes the last ``W-1`` inputs of ``[old state, new tokens]`` (pre-conv), stored in
        ``conv_state.dtype``. Zero-length sequences and all other slots are left unchanged.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {_ACTIVATIONS}")
    T, C = x.shape
    W = weight.shape[1]
    N = state_indices.numel()
    if weight.shape != (C, W) or conv_state.shape[1:] != (C, W - 1):
        raise ValueError(
            f"weight must be [C={C}, W] and conv_state [S, C, W-1]; "
            f"got {tuple(weight.shape)} and {tuple(conv_state.shape)}"
        )
    if cu_seqlens.shape != (N + 1,) or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
        raise ValueError(f"cu_seqlens must be [N+1={N + 1}] from 0 to T={T}; got {cu_seqlens.tolist()}")

    w = weight.float()
    y = torch.empty(T, C, dtype=torch.float32, device=x.device)
    bounds = cu_seqlens.tolist()
    for n, slot in enumerate(state_indices.tolist()):
        bos, eos = bounds[n], bounds[n + 1]
        if eos == bos:
            continue
        # [W-1 + L, C]: old state (oldest first) followed by the new tokens.
        history = torch.cat([conv_state[slot].float().T, x[bos:eos].float()], dim=0)
        y[bos:eos] = _conv_one_sequence(history, w)
        if W > 1:
            conv_state[slot] = history[-(W - 1):].T.to(conv_state.dtype)
    if activation == "silu":
        y = F.silu(y)
    if out is not None:
        return out.copy_(y.view(out.shape))
    return y.to(x.dtype)
