"""Check that the batched training op forms compute the model's reference function (logits and gradients).

    python scripts/default_model/check_train_ops.py        # a reduced geometry, fp32, on the CPU (~10 s)
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_config import hf_config
from train import init_weights
from train_ops import ExpertLoad, training_ops

from tokenspeed import ops
from tokenspeed.models import (
    CacheBuffers,
    ForwardBatch,
    KimiForCausalLM,
    parse_hf_config,
)

SMALL = {"vocab_size": 8192, "hidden_size": 64, "q_lora_rank": 32, "kv_lora_rank": 32,
         "linear_attn_config": {"full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7], "num_heads": 2,
                                "head_dim": 16, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                                "gate_lower_bound": -5.0}}


def run(model, ids: list[list[int]], page: int = 16):
    n, length = len(ids), len(ids[0])
    pages = -(-length // page)
    batch = ForwardBatch.build(ids, [0] * n, [list(range(i * pages, (i + 1) * pages)) for i in range(n)],
                               list(range(n)), page)
    cache = CacheBuffers.allocate(model.config, n * pages, page, n, model.dtype, model.device)
    return model(batch, cache)


def check(overrides: dict, n: int = 3, length: int = 80, seed: int = 0) -> tuple[float, float]:
    torch.manual_seed(seed)
    model = KimiForCausalLM(parse_hf_config(hf_config(**overrides)), dtype=torch.float32)
    init_weights(model, seed)
    with torch.no_grad():  # non-trivial correction bias and pseudo-queries
        for name, p in model.named_parameters():
            if "res_proj" in name or "e_score_correction_bias" in name:
                p.normal_(0, 0.1)
    for p in model.parameters():
        p.requires_grad_(True)
    ids = torch.randint(0, 7936, (n, length)).tolist()
    grads, logits = [], []
    for fast in (False, True):
        model.zero_grad()
        if fast:
            with training_ops(ExpertLoad()):
                out = run(model, ids)
        else:  # the chunked reference KDA writes its state in place (no autograd); the recurrent form is exact
            ref = ops.kda_scan
            ops.kda_scan = functools.partial(ref, form="recurrent")
            try:
                out = run(model, ids)
            finally:
                ops.kda_scan = ref
        (out.float().logsumexp(-1).sum() + out[:, :7].sum()).backward()
        logits.append(out.detach())
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    err_logits = ((logits[0] - logits[1]).abs().max() / logits[0].abs().max()).item()
    err_grads = ((grads[0] - grads[1]).abs().max() / grads[0].abs().max()).item()
    return err_logits, err_grads


def main() -> None:
    for overrides in (SMALL, {}):
        el, eg = check(overrides)
        print(f"{'reduced' if overrides else 'full'} geometry: max rel err logits {el:.2e}, grads {eg:.2e}")
        assert el < 1e-4 and eg < 1e-4


if __name__ == "__main__":
    main()
