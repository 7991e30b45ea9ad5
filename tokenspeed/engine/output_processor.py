"""Turns token-level EngineOutputs into RequestOutputs: detokenization, stop strings, accumulated logprobs.

Runs in the caller's process (the offline `LLM`, or the HTTP server), so text work never stalls the engine loop.
When a stop string ends a request, the processor finishes it and reports its id: the caller aborts it in the
engine (which may have produced a token more meanwhile; tokens for finished requests are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed.core.sampling_params import SamplingParams
from tokenspeed.engine.detokenizer import IncrementalDetokenizer
from tokenspeed.engine.outputs import CompletionOutput, EngineOutput, RequestMetrics, RequestOutput, Usage
from tokenspeed.engine.tokenizer import Tokenizer


@dataclass
class _State:
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    prompt: str | None
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finished: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _State] = {}

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None,
            index: int = 0) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens, list(params.stop),
                                       params.include_stop_str_in_output)
        self.states[request_id] = _State(prompt_ids, params, detok, prompt, index)

    def process(self, outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(request outputs, ids to abort in the engine because a stop string ended them)."""
        results, to_abort = [], []
        for out in outputs:
            st = self.states.get(out.request_id)
            if st is None or st.finished:
                continue
            if out.prompt_logprobs:
                st.prompt_logprobs = (st.prompt_logprobs or [None]) + list(out.prompt_logprobs)
            new_ids = [t for t in out.new_token_ids if t not in self._hidden_eos(st, out)]
            st.token_ids.extend(out.new_token_ids)
            if out.logprobs is not None:
                st.logprobs.extend(out.logprobs)
                st.top_logprobs.extend(out.top_logprobs or [[] for _ in out.logprobs])
            delta = st.detok.push(new_ids) if new_ids else ""
            if st.detok.stopped is not None:
                st.finish_reason, st.stop_reason, st.finished = "stop", st.detok.stopped, True
                if not out.finished:
                    to_abort.append(out.request_id)
            elif out.finished:
                delta += st.detok.finish()
                st.finish_reason, st.stop_reason, st.finished = out.finish_reason, out.stop_reason, True
            if not out.new_token_ids and not st.finished:
                continue  # a prompt-logprobs-only chunk
            results.append(self._output(out.request_id, st, out, delta, out.new_token_ids))
        return results, to_abort

    @staticmethod
    def _hidden_eos(st: _State, out: EngineOutput) -> set[int]:
        """The token that ended a request by eos / stop_token_ids is not part of the text."""
        if out.finished and out.finish_reason == "stop" and out.new_token_ids:
            return {out.new_token_ids[-1]}
        return set()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request as aborted (client gone, engine error); its final output, or None if unknown."""
        st = self.states.pop(request_id, None)
        if st is None:
            return None
        st.finished, st.finish_reason = True, st.finish_reason or "abort"
        out = EngineOutput(request_id, [], True, st.finish_reason, st.stop_reason, len(st.prompt_ids), 0,
                           len(st.token_ids))
        return self._output(request_id, st, out, "", [])

    def _output(self, rid: str, st: _State, out: EngineOutput, delta: str, new_ids: list[int]) -> RequestOutput:
        if st.finished:
            self.states.pop(rid, None)
        p = st.params
        completion = CompletionOutput(
            index=st.index, text=st.detok.text, token_ids=list(st.token_ids), finish_reason=st.finish_reason,
            stop_reason=st.stop_reason, logprobs=list(st.logprobs) if p.logprobs is not None else None,
            top_logprobs=list(st.top_logprobs) if p.logprobs else None, delta_text=delta, delta_token_ids=new_ids,
        )
        usage = Usage(len(st.prompt_ids), len(st.token_ids), out.num_cached_tokens)
        metrics = RequestMetrics(out.queue_time, out.ttft, out.e2e, out.num_preemptions, out.num_draft_tokens,
                                 out.num_accepted_tokens, out.num_spec_steps)
        return RequestOutput(rid, st.prompt_ids, [completion], st.finished, usage, metrics, st.prompt,
                             st.prompt_logprobs)
