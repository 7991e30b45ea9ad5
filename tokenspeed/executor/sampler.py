"""Batched token sampling for one step: logits [B, V] of B sequences -> one token (and logprobs) per sequence.

Order, per row (vLLM / OpenAI semantics):
  1. raw logprobs: log_softmax of the logits as given (before any penalty or temperature) — what is reported;
  2. penalties: repetition (tokens in prompt + output: positive logits / r, negative logits * r), then
     frequency (- f * count in output) and presence (- p * [count > 0] in output);
  3. logit_bias: each row's token -> bias values added;
  4. min_tokens: while fewer than min_tokens tokens were generated, stop_token_ids and EOS (unless ignore_eos)
     get -inf;
  5. greedy rows (temperature 0 or top_k 1): argmax, ties to the lowest id;
  6. other rows: logits / temperature, top-k (the k first in descending order, ties to the lower id), top-p
     (the shortest prefix whose mass is >= top_p, at least one token), min-p (drop p < min_p * p_max), then one
     draw from the renormalised distribution.

Randomness: each sampled row draws exactly one uniform number per step, from its own `torch.Generator` when it
has one (a seeded request) and from torch's global default generator otherwise, and picks the token by inverse
CDF over its sorted kept probabilities. A seeded row's tokens therefore depend only on its seed, its logits and its
step count — never on which other rows share the batch — and the draw costs one number, not V, so CPU generators
also serve logits on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from tokenspeed.core.sampling_params import SamplingParams
from tokenspeed.ops.h2d import to_device


@dataclass(frozen=True, slots=True)
class SamplerInput:
    """One row of a step: the request's parameters and the tokens it has so far.

    `generator` is the request's own random stream (`make_generator(params.seed)`), created once per request and
    kept across steps; `sample` advances it by one draw per step in which the row is sampled (not for greedy rows).
    None uses torch's global default generator. `eos_token_ids` are masked while min_tokens is not reached.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int] = ()
    generator: torch.Generator | None = None
    eos_token_ids: Sequence[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SampleOutput:
    """The step's result, one entry per row, in row order.

    token_ids: the chosen token of every row. logprobs: raw log_softmax(logits)[row, token] of every row, or None
    when no row asked for logprobs. top_logprobs: for rows with params.logprobs = n, the n highest raw
    (token_id, logprob) pairs in descending order (ties: lower id first); [] for the other rows; None when no row
    asked.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The random stream of a request: a generator seeded with `seed`, or None (use the global one) for no seed."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits: Tensor, rows: Sequence[SamplerInput]) -> SampleOutput:
    """Choose one token per row of `logits` [B, V] (fp32; other float dtypes are upcast; any device).

    `logits` is not modified. Token ids in `rows` must lie in [0, V). Generators of sampled rows advance by one draw.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [B, V] with B = {len(rows)} rows, got {tuple(logits.shape)}")
    if _plain_greedy(rows):  # the common decode batch: one argmax, one copy to the host
        # argmax is the same on the exact fp32 upcast of bf16 / fp16 logits: skip the upcast for those.
        exact = logits if logits.dtype in (torch.float32, torch.bfloat16, torch.float16) else logits.float()
        return SampleOutput(token_ids=exact.argmax(dim=-1).tolist())
    logits = logits.float()
    wants_logprobs = any(row.params.logprobs is not None for row in rows)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else logits  # unused unless asked
    processed = apply_penalties(logits, rows)
    processed = apply_logit_bias(processed, rows, in_place=processed is not logits)
    processed = mask_min_tokens(processed, rows)
    return _gather_logprobs(raw_logprobs, _choose(processed, rows), rows)


def sample_on_device(logits: Tensor, rows: Sequence[SamplerInput]) -> Tensor:
    """The tokens `sample` would choose, as an [B] int64 tensor on logits' device, without a host
    synchronisation (asynchronous scheduling), for rows with no penalty, no min_tokens mask and no logprobs
    (`samples_on_device`); their output tokens are not read. Generators of sampled rows advance by one draw."""
    if not all(samples_on_device(row.params) for row in rows):
        raise ValueError("sample_on_device: a row needs penalties, min_tokens or logprobs (use `sample`)")
    return _choose(logits.float(), rows)


def samples_on_device(p: SamplingParams) -> bool:
    """True when a request's tokens can be chosen without its output tokens or a host read-back: no penalty, no
    min_tokens, no logprobs, no logit_bias."""
    return not _edits_logits(p) and p.min_tokens == 0 and p.logprobs is None


def _choose(processed: Tensor, rows: Sequence[SamplerInput]) -> Tensor:
    """[B] int64 on processed's device: argmax for greedy rows, one filtered draw for the others (index tensors go
    to the device pinned and non-blocking: no host synchronisation)."""
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not sampled:
        return processed.argmax(dim=-1)
    params = [rows[i].params for i in sampled]
    uniforms = _draw_uniforms([rows[i].generator for i in sampled], processed.device)
    if len(sampled) == len(rows):
        return sample_filtered(processed, params, uniforms)
    idx = to_device(sampled, torch.long, processed.device)
    token_ids = processed.argmax(dim=-1)
    return token_ids.index_copy_(0, idx, sample_filtered(processed.index_select(0, idx), params, uniforms))


def apply_penalties(logits: Tensor, rows: Sequence[SamplerInput]) -> Tensor:
    """`logits` [B, V] with the repetition, frequency and presence penalties of `rows` applied, as a copy; when no
    row has a penalty, `logits` itself (a copy if some row still masks min_tokens, which writes in place).

    repetition r: for tokens in prompt or output, l > 0 -> l / r, else l * r. frequency f / presence p (output
    tokens only): l -= f * count + p * [count > 0]. Rows with default penalties are returned unchanged.
    """
    idx = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
    if not idx:
        return logits.clone() if any(r.params.min_tokens > len(r.output_token_ids) for r in rows) else logits
    out = logits.clone()
    vocab, device = logits.shape[1], logits.device
    counts = _token_counts([rows[i].output_token_ids for i in idx], vocab, device)
    prompt_counts = _token_counts([rows[i].prompt_token_ids for i in idx], vocab, device)

    def column(name: str) -> Tensor:
        return torch.tensor([getattr(rows[i].params, name) for i in idx], dtype=torch.float32, device=device)[:, None]

    rep = column("repetition_penalty")
    sub = out[idx]
    seen = (counts > 0) | (prompt_counts > 0)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0).float()
    out[idx] = sub
    return out


def apply_logit_bias(logits: Tensor, rows: Sequence[SamplerInput], in_place: bool) -> Tensor:
    """`logits` [B, V] plus each row's params.logit_bias (token id -> bias) at those tokens: in place when
    `in_place` (the caller's own copy), else on a copy; `logits` itself when no row has a bias."""
    entries = [(i, tok, b) for i, r in enumerate(rows) if r.params.logit_bias for tok, b in r.params.logit_bias.items()]
    if not entries:
        return logits
    out = logits if in_place else logits.clone()
    rows_i, toks, biases = zip(*entries, strict=True)
    dev = logits.device
    out.index_put_((to_device(list(rows_i), torch.long, dev), to_device(list(toks), torch.long, dev)),
                   to_device(list(biases), out.dtype, dev), accumulate=True)
    return out


def mask_min_tokens(logits: Tensor, rows: Sequence[SamplerInput]) -> Tensor:
    """Set -inf (in place; returns `logits`) at stop_token_ids and EOS (EOS unless ignore_eos) of every row with
    fewer than params.min_tokens output tokens."""
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(row.eos_token_ids))
        if stops:
            logits[i, torch.tensor(stops, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def sample_filtered(logits: Tensor, params: Sequence[SamplingParams], uniforms: Tensor) -> Tensor:
    """Draw one token per row of `logits` [S, V] after temperature, top-k, top-p and min-p. Returns [S] int64.

    `uniforms` [S] float64 in [0, 1) (same device) are the rows' random numbers: the token is the first one, in
    descending-probability order (ties: lower id first), whose cumulative kept probability exceeds u * total.
    When no row filters (top_k, top_p, min_p all off) the order is the vocabulary's instead: the same
    distribution without sorting the vocabulary (a [64, 163840] sort costs milliseconds on a GPU).
    Needs at least one finite logit per row. `logits` is not modified.
    """
    device, vocab = logits.device, logits.shape[1]
    temperature = to_device([p.temperature for p in params], torch.float32, device)[:, None]
    # Subtract the row max before dividing so a tiny temperature cannot overflow to inf (inf - inf = nan).
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if all((p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1 and p.min_p <= 0 for p in params):
        return _inverse_cdf(torch.softmax(scaled, dim=-1), uniforms)
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab, device=device)[None, :]

    top_k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.long, device)[:, None]
    sorted_logits = sorted_logits.masked_fill(positions >= top_k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)

    # top-p: keep token j while the mass strictly before it is < top_p (position 0 always stays).
    # top_p == 1 disables the cut (fp32 cumsum may exceed 1 and would drop tail tokens otherwise).
    top_p = to_device([p.top_p if p.top_p < 1 else float("inf") for p in params], torch.float32, device)[:, None]
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p, 0.0)

    # min-p: the ratio p / p_max does not change under renormalisation; p_max is position 0.
    min_p = to_device([p.min_p for p in params], torch.float32, device)[:, None]
    probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)

    # Kept tokens are a prefix of the sorted order.
    return sorted_ids.gather(1, _inverse_cdf(probs, uniforms)[:, None]).squeeze(1)


def _inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Per row of probs [S, V] (unnormalised, >= 0), the first position whose float64 cumulative mass exceeds
    u * total, clamped to the last position with mass > 0 (guards the rounding case u * total == total)."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    targets = uniforms.to(torch.float64)[:, None] * cdf[:, -1:]
    pos = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    positions = torch.arange(probs.shape[1], device=probs.device)
    last_kept = torch.where(probs > 0, positions, -1).amax(dim=-1)
    return torch.minimum(pos, last_kept)


def prompt_logprobs(logits: Tensor, prompt_ids: Sequence[int], top_n: int) -> list[dict[int, float] | None]:
    """Raw logprobs of a prompt's own tokens from the prefill logits [T, V] of its T = len(prompt_ids) tokens.

    Row t of `logits` predicts token t + 1, so entry t (t >= 1) is a dict {token_id: logprob} holding the actual
    prompt_ids[t] first, then the top_n most likely tokens of row t - 1 in descending order (ties: lower id first;
    the actual token appears once, so a dict has top_n or top_n + 1 entries). Entry 0 is None: the first token has
    no prefix (OpenAI / vLLM convention). The last logits row predicts the first generated token and is unused.
    """
    if logits.dim() != 2 or logits.shape[0] != len(prompt_ids):
        raise ValueError(f"logits must be [T, V] with T = {len(prompt_ids)} prompt tokens, got {tuple(logits.shape)}")
    if not prompt_ids:
        return []
    return [None, *prompt_logprobs_chunk(logits, prompt_ids, 0, top_n)]


def prompt_logprobs_chunk(logits: Tensor, prompt_ids: Sequence[int], start: int, top_n: int) -> list[dict[int, float]]:
    """Prompt logprobs of one prefill chunk: `logits` [C, V] are the rows of prompt positions start .. start + C - 1.

    Row j predicts prompt_ids[start + j + 1], so this returns the entries (format of `prompt_logprobs`) of prompt
    positions start + 1 .. min(start + C, len(prompt_ids) - 1); a row that predicts past the prompt is ignored.
    Concatenating the chunks of a whole prompt after a leading None gives `prompt_logprobs`.
    """
    if top_n < 0:
        raise ValueError(f"top_n must be >= 0, got {top_n}")
    if logits.dim() != 2 or start < 0:
        raise ValueError(f"logits must be [C, V] and start >= 0, got {tuple(logits.shape)} and {start}")
    count = max(0, min(logits.shape[0], len(prompt_ids) - 1 - start))
    if count == 0:
        return []
    logprobs = torch.log_softmax(logits[:count].float(), dim=-1)
    next_ids = [int(t) for t in prompt_ids[start + 1 : start + 1 + count]]
    targets = torch.tensor(next_ids, dtype=torch.long, device=logits.device)
    actual = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    entries = []
    for tok, lp, top in zip(next_ids, actual, _top_n(logprobs, top_n), strict=True):
        entry = {tok: lp}
        for tid, tlp in top:
            entry.setdefault(tid, tlp)
        entries.append(entry)
    return entries


def is_plain_greedy(p: SamplingParams, num_output_tokens: int) -> bool:
    """True when a row with these params and this many output tokens is greedy with no penalty, no logit_bias, no
    min_tokens mask in force and no logprobs: its token is then the argmax of its logits as given."""
    return p.greedy and p.logprobs is None and not _edits_logits(p) and num_output_tokens >= p.min_tokens


def _plain_greedy(rows: Sequence[SamplerInput]) -> bool:
    return all(is_plain_greedy(row.params, len(row.output_token_ids)) for row in rows)


def _edits_logits(p: SamplingParams) -> bool:
    """A penalty or a logit_bias: the row's logits are changed on the host before the choice."""
    return _has_penalty(p) or bool(p.logit_bias)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> Tensor:
    """[R, V] float32 occurrence counts of each row's tokens. Raises ValueError for an id outside [0, V)."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long, device=device)
    flat = torch.tensor([tok for t in token_lists for tok in t], dtype=torch.long, device=device)
    if flat.numel() and (flat.min().item() < 0 or flat.max().item() >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab})")
    row_of = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    counts.index_put_((row_of, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts


def _draw_uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> Tensor:
    """[S] float64 uniforms in [0, 1) on `device`: one draw from each row's own generator; rows without one take
    theirs, in row order, from torch's global default CPU generator (a single call)."""
    values = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        values[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            values[i] = torch.rand((), generator=g, dtype=torch.float64, device=g.device).item()
    return to_device(values, torch.float64, device)


def _top_n(logprobs: Tensor, n: int) -> list[list[tuple[int, float]]]:
    """Per row of `logprobs` [R, V], the n largest (token_id, logprob) pairs, descending, ties to the lower id."""
    if n == 0:
        return [[] for _ in range(logprobs.shape[0])]
    values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    values, ids = values[:, :n].tolist(), ids[:, :n].tolist()
    return [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]


def _gather_logprobs(raw_logprobs: Tensor, token_ids: Tensor, rows: Sequence[SamplerInput]) -> SampleOutput:
    """Assemble SampleOutput: the chosen ids, and raw logprobs / top-n only when some row asked for them."""
    ids = token_ids.tolist()
    asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not asked:
        return SampleOutput(token_ids=ids)
    chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    most = max(rows[i].params.logprobs for i in asked)
    tops = _top_n(raw_logprobs[asked], most)
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    for i, row_top in zip(asked, tops, strict=True):
        top[i] = row_top[: rows[i].params.logprobs]
    return SampleOutput(token_ids=ids, logprobs=chosen, top_logprobs=top)
