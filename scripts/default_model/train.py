"""Train the default model (kimi-k3-mini) with TokenSpeed's own KimiForCausalLM forward.

Fixed-length windows of the packed training stream; AdamW, linear warm-up then cosine decay; the router's
noaux correction bias is updated by load (DeepSeek-V3's auxiliary-loss-free balancing, no aux loss). The model
runs in fp32 (TF32 matmuls while training), through the batched op forms of `train_ops`. At the end the
weights are rounded to bf16 and written as a kimi_k3 checkpoint (fp32 islands stay fp32, as the official
checkpoint), which is then reloaded in fp32 and measured with TF32 off:
- held-out loss: mean next-token NLL over the held-out stream in windows of --seq-len predictions, each window
  from an empty state (batched op forms; a few windows are cross-checked against the reference ops);
- the snippet set (snippets.json): per-snippet NLL through `forward_logits` with the reference ops, the
  numbers the engine must reproduce (tests/models/test_default_model.py).

    python scripts/default_model/train.py --device cuda --time-budget 300 --out OUT_DIR
    python scripts/default_model/train.py --device cpu --steps 20 --batch-size 4 --seq-len 128   # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Training needs autograd, which only the torch reference ops have (the Triton kernels are inference-only); the
# shipped held-out numbers are measured with the reference ops as well.
os.environ["TOKENSPEED_OPS"] = "reference"

from model_config import hf_config
from train_ops import ExpertLoad, training_ops

from tokenspeed.models import (
    CacheBuffers,
    ForwardBatch,
    KimiForCausalLM,
    forward_logits,
    load_model,
    parse_hf_config,
)
from tokenspeed.models.checkpoint import save_checkpoint
from tokenspeed.models.weights import checkpoint_prefix, init_dummy_weights

DATA = Path(__file__).resolve().parents[2] / "build" / "default_model" / "data"
PAGE = 64
NO_DECAY = ("norm", "A_log", "dt_bias", "conv_weight", "res_proj", "embed_tokens")


def init_weights(model: KimiForCausalLM, seed: int) -> None:
    """init_dummy_weights (N(0, 1/fan_in) matrices, residual outputs / sqrt(2L), KDA gates in trained ranges),
    then unit norm gains, zero AttnRes pseudo-queries (uniform depth mix) and zero router correction bias."""
    init_dummy_weights(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "res_proj" in name or name.endswith("e_score_correction_bias"):
                p.zero_()


def make_batch(n: int, length: int, device) -> ForwardBatch:
    pages = length // PAGE
    return ForwardBatch.build([[0] * length] * n, [0] * n, [list(range(i * pages, (i + 1) * pages)) for i in range(n)],
                              list(range(n)), PAGE, device)


def batch_loss(model, batch: ForwardBatch, windows: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """NLL of windows [N, L+1] (predict tokens 1..L from an empty state)."""
    n, l1 = windows.shape
    batch.input_ids = windows[:, :-1].reshape(-1).long()
    cache = CacheBuffers.allocate(model.config, n * (l1 - 1) // PAGE, PAGE, n, model.dtype, model.device)
    logits = model(batch, cache)
    return F.cross_entropy(logits, windows[:, 1:].reshape(-1).long(), reduction=reduction)


def heldout_windows(stream: torch.Tensor, length: int) -> torch.Tensor:
    count = (stream.numel() - 1) // length
    idx = torch.arange(count, device=stream.device)[:, None] * length + torch.arange(length + 1, device=stream.device)
    return stream[idx]


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, length: int, batch_size: int, limit: int | None = None) -> float:
    windows = heldout_windows(stream, length)[:limit]
    total, count = 0.0, 0
    with training_ops():
        for i in range(0, windows.shape[0], batch_size):
            w = windows[i:i + batch_size]
            total += batch_loss(model, make_batch(w.shape[0], length, model.device), w, "sum").item()
            count += w.shape[0] * length
    return total / count


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.requires_grad_(False)  # moved by expert load, not by gradients
            continue
        p.requires_grad_(True)
        (no_decay if any(k in name for k in NO_DECAY) or p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(progress: float, step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = min(max(progress, 0.0), 1.0)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def export(model: KimiForCausalLM, cfg: dict, out: Path) -> Path:
    """Round to bf16 (fp32 islands stay fp32) and write config.json + model.safetensors."""
    bf16 = KimiForCausalLM(parse_hf_config(cfg), dtype=torch.bfloat16, device="cpu")
    src = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in bf16.named_parameters():
            p.copy_(src[name].detach().to("cpu", p.dtype))
    return save_checkpoint(bf16, cfg, out, checkpoint_prefix(bf16.config))


def train(args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    train_stream = torch.from_numpy(np.load(args.data / "train.npy").astype(np.int32)).to(device)
    held_stream = torch.from_numpy(np.load(args.data / "heldout.npy").astype(np.int32)).to(device)
    cfg = hf_config(**json.loads(args.config_overrides or "{}"))
    model = KimiForCausalLM(parse_hf_config(cfg), dtype=torch.float32, device=device)
    init_weights(model, args.seed)
    moe_layers = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    num_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if device.type == "cuda" else {}))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    print(f"params {num_params:,}; train tokens {train_stream.numel():,}; held-out {held_stream.numel():,}; "
          f"batch {args.batch_size} x {args.seq_len}", flush=True)

    gen = torch.Generator(device=device).manual_seed(args.seed)
    batch = make_batch(args.batch_size, args.seq_len, device)
    span = torch.arange(args.seq_len + 1, device=device)
    load = ExpertLoad()
    log, step, t_train, skipped = [], 0, 0.0, 0
    t_start = time.time()
    model.train()
    while True:
        progress = step / args.steps if args.steps else t_train / args.time_budget
        if progress >= 1.0:
            break
        lr = lr_at(progress, step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        t0 = time.time()
        offsets = torch.randint(0, train_stream.numel() - args.seq_len - 1, (args.batch_size,), device=device,
                                generator=gen)
        windows = train_stream[offsets[:, None] + span]
        load.counts.clear()
        try:
            with training_ops(load):
                loss = batch_loss(model, batch, windows)
            loss.backward()
        except torch.OutOfMemoryError:
            loss = None
        if loss is None:  # halve the batch and go on (the step is not counted)
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            args.batch_size //= 2
            if args.batch_size < 1:
                raise RuntimeError("out of memory at batch size 1")
            print(f"out of memory: batch size now {args.batch_size}", flush=True)
            batch = make_batch(args.batch_size, args.seq_len, device)
            continue
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if torch.isfinite(gnorm):
            opt.step()
        else:
            skipped += 1
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # auxiliary-loss-free balancing: push the bias of over-loaded experts down
            for moe, counts in zip(moe_layers, load.counts, strict=True):
                moe.gate.e_score_correction_bias -= args.bias_rate * torch.sign(counts - counts.mean())
        step += 1
        if step % args.log_every == 0 or step == 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_train += time.time() - t0
            entry = {"step": step, "loss": round(loss.item(), 4), "lr": lr, "gnorm": round(gnorm.item(), 3),
                     "time": round(time.time() - t_start, 1)}
            if device.type == "cuda" and step == 1:
                entry["max_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            if step % args.eval_every == 0:
                model.eval()
                entry["heldout"] = round(heldout_loss(model, held_stream, args.seq_len, args.batch_size, 64), 4)
                model.train()
            log.append(entry)
            print(json.dumps(entry), flush=True)
        else:
            t_train += time.time() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_time = time.time() - t_start
    print(f"trained {step} steps in {train_time:.1f}s ({skipped} skipped)", flush=True)

    out = Path(args.out)
    export(model, cfg, out)
    info = {"params": num_params, "steps": step, "train_seconds": round(train_time, 1), "skipped_steps": skipped,
            "tokens_seen": step * args.batch_size * args.seq_len, "args": {k: str(v) for k, v in vars(args).items()},
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "log": log}
    (out / "train_log.json").write_text(json.dumps(info, indent=1))
    return info


def evaluate(args, info: dict) -> dict:
    """Reload the exported bf16 checkpoint in fp32 and measure the held-out numbers (TF32 off)."""
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    out = Path(args.out)
    model = load_model(out, dtype=torch.float32, device=device)
    held = torch.from_numpy(np.load(args.data / "heldout.npy").astype(np.int32)).to(device)
    t0 = time.time()
    windows = heldout_windows(held, args.seq_len)[:args.eval_limit]
    loss = heldout_loss(model, held, args.seq_len, args.batch_size, args.eval_limit)
    meta = json.loads((args.data / "meta.json").read_text())
    n_pred = windows.shape[0] * args.seq_len
    result = {
        "heldout_loss": loss, "heldout_perplexity": math.exp(loss), "heldout_windows": windows.shape[0],
        "window": args.seq_len, "heldout_predictions": n_pred,
        "heldout_bits_per_byte": loss / math.log(2) * meta["heldout_tokens"] / meta["heldout_bytes"],
    }
    # Cross-check: a few windows through the reference ops (forward_logits, one sequence at a time).
    ref = [F.cross_entropy(forward_logits(model, w[:-1].tolist()), w[1:].long()).item() for w in windows[:3]]
    with torch.no_grad():
        fast = [heldout_loss(model, w, args.seq_len, 1) for w in windows[:3]]
    result["reference_vs_batched_windows"] = [[r, f] for r, f in zip(ref, fast)]
    snippets_path = args.data / "snippets.json"
    if snippets_path.is_file():
        snippets = json.loads(snippets_path.read_text())
        per = []
        for s in snippets:
            ids = torch.tensor(s["ids"], device=device)
            per.append(F.cross_entropy(forward_logits(model, s["ids"])[:-1], ids[1:]).item())
        result["snippets"] = [{"text": s["text"], "source": s["source"], "num_tokens": len(s["ids"]), "loss": v}
                              for s, v in zip(snippets, per)]
        total = sum(v * (len(s["ids"]) - 1) for s, v in zip(snippets, per))
        result["snippet_loss"] = total / sum(len(s["ids"]) - 1 for s in snippets)
    result["eval_seconds"] = round(time.time() - t0, 1)
    result.update({k: info[k] for k in ("params", "steps", "train_seconds", "tokens_seen", "device")})
    (out / "train_eval.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "snippets"}, indent=1), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds of training (when --steps is 0)")
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (schedule by steps, not time)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="router correction-bias step per update")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-overrides", default="", help="JSON of text_config overrides (smoke tests)")
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--eval-limit", type=int, default=None, help="held-out windows to measure (default: all)")
    args = ap.parse_args()
    if args.seq_len % PAGE:
        ap.error(f"--seq-len must be a multiple of {PAGE}")
    info = train(args)
    if not args.skip_eval:
        try:
            evaluate(args, info)
        except Exception:  # noqa: BLE001 - the checkpoint is written; keep it even if a measurement breaks
            traceback.print_exc()


if __name__ == "__main__":
    main()
