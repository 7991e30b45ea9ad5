"""Triton kernels behind `tokenspeed.ops` (issue 7).

Nothing here is imported by `tokenspeed.ops` until a call needs it (`tokenspeed.ops.dispatch` imports a kernel
module lazily), so CPU-only runs never import Triton. Each module mirrors one reference module in
`tokenspeed.ops.reference` and computes the same function (see docs/kernels.md for the numerics and the layouts):

- `norm`:       `rms_norm`, `gated_rms_norm`, `add_rms_norm` (residual add fused with the norm)
- `activation`: `gated_activation`, `gated_activation_merged` (SiLU / SiTU of gate and up, one pass)
- `attn_res`:   `attn_res_mix`, `attn_res_mix_rms_norm`
- `moe_route`:  `moe_route` (sigmoid / softmax, bias-corrected top-k, renormalise) in one launch
- `moe_gate`:   `moe_gate`, the attention junction (add + RMSNorm), the router GEMV and the routing in one launch
- `kda_decode`: `kda_decode`, the fused conv + SiLU + L2 norm + gate + beta + recurrence step for 1..k tokens
  (optionally with the output gated RMSNorm in its epilogue); `kda_config`: its launch configurations;
  `kda_decode_kernel`: the jit kernel behind it
- `mla_decode`, `mla_split_plan`, `mla_prep`, `mla_combine_uv`: absorbed paged MLA (uniform or ragged queries);
  its device-side split plan (shared by the split and combine kernels); the kv_a norm + latent cache write
  (optionally with the W_UK absorption); the split combine with the W_UV product
- `moe_align`, `moe_experts`, `moe_combine`, `moe_config`: routed experts (alignment, GEMMs, combine /
  combine + add + norm; configs)
- `gemv`: the small-M projections behind `linear`
- `pdl`: the programmatic-dependent-launch protocol every decode kernel follows (`moe_pdl`: the MoE kernels' part)

Every wrapper takes CUDA tensors (or CPU tensors when `TRITON_INTERPRET=1` was set before Triton was imported,
which is how the CPU tests run them), launches one kernel, never synchronises with the host and allocates only
its outputs, so it can be captured in a CUDA graph.
"""
