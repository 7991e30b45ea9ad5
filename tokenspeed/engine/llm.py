"""The offline API: `LLM(model).generate(prompts, params)`.

    from tokenspeed import LLM, SamplingParams
    llm = LLM("tiny-k3")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    print(out[0].outputs[0].text, out[0].usage)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tokenspeed.config import EngineConfig
from tokenspeed.core.sampling_params import SamplingParams
from tokenspeed.engine.core import EngineCore
from tokenspeed.engine.output_processor import OutputProcessor
from tokenspeed.engine.outputs import RequestOutput

Prompt = str | list[int]


class LLM:
    """Runs the engine in this process. Options are EngineConfig fields (page_size=..., max_num_seqs=...)."""

    def __init__(self, model: str = "tiny-k3", **options: Any) -> None:
        self.engine = EngineCore(EngineConfig.create(model=model, **options))
        self.processor = OutputProcessor(self.engine.tokenizer)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def add_request(self, prompt: Prompt, params: SamplingParams, index: int = 0) -> str:
        """Tokenize (if text), validate and queue one request; raises RequestError for bad input."""
        text, ids = (prompt, self.tokenizer.encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        rid = f"req-{next(self._ids)}"
        self.engine.add_request(rid, ids, params)
        self.processor.add(rid, ids, params, text, index)
        return rid

    def step(self) -> list[RequestOutput]:
        """One engine step; request outputs (streaming deltas included)."""
        outputs, to_abort = self.processor.process(self.engine.step())
        for rid in to_abort:
            self.engine.abort(rid)
        return outputs

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); returns one finished output per prompt, in order.

        A request with n > 1 yields one RequestOutput whose `outputs` hold the n completions.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        groups: list[list[str]] = []
        for prompt, p in zip(prompts, params_list):
            one = p.clone(n=1)
            groups.append([
                self.add_request(prompt, one if p.seed is None else one.clone(seed=p.seed + i), index=i)
                for i in range(p.n)
            ])
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_work:
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
        return [self._merge([finished[i] for i in ids]) for ids in groups]

    @staticmethod
    def _merge(parts: list[RequestOutput]) -> RequestOutput:
        first = parts[0]
        if len(parts) == 1:
            return first
        first.outputs = [p.outputs[0] for p in parts]
        first.usage.completion_tokens = sum(p.usage.completion_tokens for p in parts)
        return first
