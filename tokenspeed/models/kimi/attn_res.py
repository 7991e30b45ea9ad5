"""Block Attention Residuals (K3): the residual stream as block snapshots plus a partial sum.

Math: k3-architecture.md section 2.3. Per token the stack carries
  blocks: snapshots b_0 = embedding, b_j = sum of the sublayer outputs of block j-1 (at most ceil(L/B))
  partial: the sum of the sublayer outputs since the last block boundary
Each sublayer reads `mix(blocks + [partial])` through its input norm; the mixed value is never accumulated.
Nothing persists across forwards: the snapshots are rebuilt inside each forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from tokenspeed import ops
from tokenspeed.models.layers import Linear, RMSNorm


@dataclass
class ResidualStream:
    """Per-forward residual state. `blocks[:num_blocks]` are valid; `partial` is None right after a snapshot.

    blocks: [max_blocks, T, hidden] scratch (mutated as snapshots are taken).
    """

    blocks: Tensor
    num_blocks: int
    partial: Tensor | None

    @classmethod
    def start(cls, embeddings: Tensor, max_blocks: int) -> "ResidualStream":
        scratch = embeddings.new_empty(max_blocks, *embeddings.shape)
        return cls(blocks=scratch, num_blocks=0, partial=embeddings)

    @property
    def snapshots(self) -> Tensor:
        return self.blocks[: self.num_blocks]

    def snapshot(self) -> None:
        """Close a block: store the partial sum as a snapshot and start an empty one."""
        assert self.partial is not None
        self.blocks[self.num_blocks] = self.partial
        self.num_blocks += 1
        self.partial = None

    def add(self, sublayer_output: Tensor) -> None:
        self.partial = sublayer_output if self.partial is None else self.partial + sublayer_output


def depth_query(res_norm: RMSNorm, res_proj: Linear) -> Tensor:
    """A mixer's pseudo-query: the norm gain [hidden] folded into the projection [1, hidden], fp32 [hidden]."""
    return res_norm.weight.float() * res_proj.weight[0].float()


def mix_and_norm(stream: ResidualStream, query: Tensor, mix_eps: float, norm: RMSNorm) -> Tensor:
    """norm(mix(snapshots + [partial])): the input of the next sublayer. Requires a partial sum."""
    assert stream.partial is not None
    return ops.attn_res_mix_rms_norm(stream.snapshots, stream.partial, query, mix_eps, norm.weight, norm.eps)
