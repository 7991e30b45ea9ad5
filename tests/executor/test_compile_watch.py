"""`tokenspeed.executor.compile_watch`: a Triton compile after start-up is logged with the kernel's specialised
signature, its constexprs and 16-divisible arguments by name and the tokenspeed call site; the hook lets the compile go ahead
(returns None) and defers to a hook installed before it; installing it through Triton's knob chains that hook,
once however many times it is asked."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tokenspeed.executor import compile_watch


def _fire(hook):
    fn = SimpleNamespace(jit_function=SimpleNamespace(arg_names=["X", "n", "BLOCK", "PDL"]))
    return hook(key="k", repr="_demo_kernel[num_warps=4](X: *bf16, n: i32)", fn=fn,
                compile={"constants": {(2,): 128, (3,): True}, "configs": [{(0,): [["tt.divisibility", 16]]}]},
                is_manual_warmup=False, already_compiled=False)


def test_hook_logs_signature_constexprs_and_call_site(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        assert _fire(compile_watch.late_compile_hook()) is None  # None: Triton compiles
    msg = caplog.records[-1].getMessage()
    assert "_demo_kernel[num_warps=4](X: *bf16, n: i32)" in msg
    assert "{'BLOCK': 128, 'PDL': True}" in msg
    assert "divisible by 16: ['X']" in msg  # X's pointer aligned, n not
    assert "tests/executor/test_compile_watch.py" not in msg  # only tokenspeed frames are named as the site


def test_hook_chains_the_previous_one() -> None:
    seen = []
    hook = compile_watch.late_compile_hook(lambda **kw: seen.append(kw["repr"]) or "skip")
    assert _fire(hook) == "skip" and seen == ["_demo_kernel[num_warps=4](X: *bf16, n: i32)"]


def test_watch_installs_through_tritons_knob(monkeypatch, caplog) -> None:
    knobs = pytest.importorskip("triton.knobs")
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(1))
    assert compile_watch.watch_late_compiles()
    assert compile_watch.watch_late_compiles()  # a second engine: installed once, so one warning per compile
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        _fire(knobs.runtime.jit_cache_hook)
    assert seen == [1]
    assert sum("compiled after start-up" in r.getMessage() for r in caplog.records) == 1
