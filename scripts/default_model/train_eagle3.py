"""Train an EAGLE3-MLA draft for the default model (kimi-k3-mini) on the target's own features.

Each step takes N random windows of L + 1 tokens from the packed training stream (build/default_model/data), runs
the frozen target once (no grad, fp32, batched training ops of train_ops) with
`capture_layers=draft.capture_layers(target)` to get the three features and the logits of every position, and
trains the draft with teacher forcing on the EAGLE3 objective: draft position p reads (token p+1, fc(features p))
and predicts the target's next-token distribution at position p+1 (soft cross-entropy against softmax of the
target logits; top-1 agreement with the target's argmax is logged). The draft borrows the target's embedding and
lm_head (no `draft_vocab_size`), so only fc, the midlayer and the final norm are trained.

--ttt-steps 2 adds an unrolled second step (a cheap approximation of EAGLE3's training-time test): a second pass
over the same windows whose hidden input at position p is the draft's own step-1 hidden of position p-1 and
which predicts the target's distribution one position further; its loss is weighted by --ttt-weight.

    python scripts/default_model/train_eagle3.py --device cuda --time-budget 150 --out OUT_DIR
    python scripts/default_model/train_eagle3.py --device cpu --steps 3 --batch-size 2 --seq-len 64 --out /tmp/d
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["TOKENSPEED_OPS"] = "reference"  # autograd needs the torch reference ops

from train_ops import training_ops

from tokenspeed.models import CacheBuffers, ForwardBatch, load_model
from tokenspeed.models.eagle3.checkpoint import save_eagle3_checkpoint
from tokenspeed.models.eagle3.config import parse_eagle3_config
from tokenspeed.models.eagle3.model import Eagle3Draft

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "build" / "default_model" / "data"
TARGET = ROOT / "tokenspeed" / "assets" / "kimi-k3-mini"
PAGE = 64


def draft_hf_config(target_cfg) -> dict:
    """The draft's HF config: hidden 256 like the target, 4 heads, no q-LoRA, kv-LoRA 64, rope 32 (theta 1e4)."""
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": target_cfg.hidden_size,
        "target_hidden_size": target_cfg.hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "intermediate_size": 512,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": target_cfg.vocab_size,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6], "use_aux_hidden_state": True},
    }


def make_batch(n: int, length: int, device) -> ForwardBatch:
    pages = length // PAGE
    return ForwardBatch.build([[0] * length] * n, [0] * n, [list(range(i * pages, (i + 1) * pages)) for i in range(n)],
                              list(range(n)), PAGE, device)


def init_draft(draft: Eagle3Draft, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.ndim == 2:
                std = 1.0 / math.sqrt(p.shape[1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std /= math.sqrt(2)
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.zero_()


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean soft cross-entropy vs softmax(target_logits), top-1 agreement with the target's argmax)."""
    loss = -(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    acc = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    return loss, acc


def step_losses(target, draft, batch, windows, ttt_steps: int):
    """windows [N, L+1]. Returns [(loss, acc)] per unrolled step."""
    n, l1 = windows.shape
    length = l1 - 1
    device = windows.device
    with torch.no_grad():
        batch.input_ids = windows[:, :-1].reshape(-1).long()
        tcache = CacheBuffers.allocate(target.config, n * length // PAGE, PAGE, n, target.dtype, device)
        tlogits, feats = target(batch, tcache, None, capture_layers=draft.capture_layers(target))
        tlogits = tlogits.view(n, length, -1)
        feats = torch.cat(feats, -1)
    # draft position p: token w[p+1], hidden fc(f[p]); predicts target logits at p+1 (valid for p < L-1)
    tokens = windows[:, 1:].reshape(-1).long()
    hidden = draft.fuse(feats)
    out = []
    for k in range(ttt_steps):
        dcache = draft.allocate_cache(n * length // PAGE, PAGE)
        batch.input_ids = tokens
        logits, h = draft(batch, dcache, tokens, hidden)
        logits = logits.view(n, length, -1)
        # step k (0-based) at position p predicts the target's distribution at p+1 (step 0); the hidden of step
        # k > 0 at p is step k-1's hidden at p-1, so positions p < k have no valid input and are dropped.
        valid = slice(k, length - 1)
        out.append(soft_ce(logits[:, valid].reshape(-1, logits.shape[-1]),
                           tlogits[:, k + 1:length].reshape(-1, tlogits.shape[-1])))
        h = h.view(n, length, -1)
        hidden = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1).reshape(n * length, -1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--target", type=Path, default=TARGET)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--time-budget", type=float, default=150.0)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--ttt-steps", type=int, default=2)
    ap.add_argument("--ttt-weight", type=float, default=0.5)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-windows", type=int, default=256, help="held-out windows for the agreement numbers")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    target = load_model(args.target, dtype=torch.float32, device=device)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    hf = draft_hf_config(target.config)
    draft = Eagle3Draft(parse_eagle3_config(hf), dtype=torch.float32, device=device, own_embedding=False)
    init_draft(draft, args.seed)
    draft.bind_target(target)
    params = [p.requires_grad_(True) for p in draft.parameters()]
    nparams = sum(p.numel() for p in params)
    decay = [p for n, p in draft.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in draft.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    stream = torch.from_numpy(np.load(args.data / "train.npy").astype(np.int32)).to(device)
    held = torch.from_numpy(np.load(args.data / "heldout.npy").astype(np.int32)).to(device)
    print(f"draft params {nparams:,}; capture layers {draft.capture_layers(target)}; train tokens {stream.numel():,}",
          flush=True)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    batch = make_batch(args.batch_size, args.seq_len, device)
    span = torch.arange(args.seq_len + 1, device=device)
    log, step, t_start = [], 0, time.time()
    while True:
        elapsed = time.time() - t_start
        progress = step / args.steps if args.steps else elapsed / args.time_budget
        if progress >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        off = torch.randint(0, stream.numel() - args.seq_len - 1, (args.batch_size,), device=device, generator=gen)
        with training_ops():
            parts = step_losses(target, draft, batch, stream[off[:, None] + span], args.ttt_steps)
        loss = sum((1.0 if k == 0 else args.ttt_weight) * l for k, (l, _) in enumerate(parts))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            entry = {"step": step, "lr": round(lr, 6), "gnorm": round(gnorm.item(), 3),
                     "loss": [round(l.item(), 4) for l, _ in parts], "acc": [round(a.item(), 4) for _, a in parts],
                     "time": round(time.time() - t_start, 1)}
            log.append(entry)
            print(json.dumps(entry), flush=True)
    train_seconds = time.time() - t_start
    # held-out teacher-forced agreement (step 1 and the unrolled step 2)
    draft.eval()
    hb = min(16, args.eval_windows)
    windows = held[: (held.numel() - 1) // args.seq_len * args.seq_len + 1]
    count = min((windows.numel() - 1) // args.seq_len, args.eval_windows)
    idx = torch.arange(count, device=device)[:, None] * args.seq_len + span
    accs, losses = [], []
    with torch.no_grad(), training_ops():
        for i in range(0, count - hb + 1, hb):
            parts = step_losses(target, draft, make_batch(hb, args.seq_len, device), held[idx[i:i + hb]],
                                max(2, args.ttt_steps))
            losses.append([l.item() for l, _ in parts])
            accs.append([a.item() for _, a in parts])
    held_acc = np.mean(accs, 0).tolist()
    held_loss = np.mean(losses, 0).tolist()
    print(f"trained {step} steps in {train_seconds:.1f}s; held-out acc {held_acc} loss {held_loss}", flush=True)
    bf16 = Eagle3Draft(parse_eagle3_config(hf), dtype=torch.bfloat16, device="cpu", own_embedding=False)
    src = dict(draft.named_parameters())
    with torch.no_grad():
        for name, p in bf16.named_parameters():
            p.copy_(src[name].detach().to("cpu", p.dtype))
    save_eagle3_checkpoint(bf16, hf, args.out)
    info = {"draft_params": nparams, "steps": step, "train_seconds": round(train_seconds, 1),
            "tokens_seen": step * args.batch_size * args.seq_len, "heldout_top1_agreement": held_acc,
            "heldout_soft_ce": held_loss, "heldout_windows": (count // hb) * hb,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "args": {k: str(v) for k, v in vars(args).items()}, "log": log}
    (args.out / "train_log.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
