"""`tokenspeed.executor.compile_watch`: variants compiled before serving are recorded silently; one compiled after
`serving_started` is logged with its options, constexprs and 16-divisible arguments by name, what sets it apart
from the closest earlier variant of the same kernel, and the tokenspeed call site; the hook lets the compile go
ahead (returns None) and defers to a hook installed before it; installing it through Triton's knob chains that
hook, once however many times it is asked."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tokenspeed.executor import compile_watch


@pytest.fixture(autouse=True)
def _fresh_watch(monkeypatch):
    monkeypatch.setattr(compile_watch, "_compiled", {})
    monkeypatch.setattr(compile_watch, "_serving", False)


def _fire(hook, block: int = 128, aligned: bool = True, warps: int = 4):
    fn = SimpleNamespace(name="_demo_kernel", jit_function=SimpleNamespace(arg_names=["X", "n", "BLOCK", "PDL"]))
    attrs = {(0,): [["tt.divisibility", 16]]} if aligned else {}
    return hook(key=f"[('*bf16', {'D' if aligned else ''!r})]{block}{warps}",
                repr=f"_demo_kernel[num_warps={warps}, num_ctas=1](X: *bf16)", fn=fn,
                compile={"constants": {(2,): block, (3,): True}, "configs": [attrs]},
                is_manual_warmup=False, already_compiled=False)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "compiled after start-up" in r.getMessage()]


def test_compiles_before_serving_are_recorded_silently_and_later_ones_logged_with_their_difference(caplog) -> None:
    hook = compile_watch.late_compile_hook()
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        assert _fire(hook) is None and _fire(hook, block=64) is None  # None: Triton compiles
        assert _warnings(caplog) == []
        compile_watch.serving_started()
        _fire(hook, aligned=False)
    (msg,) = _warnings(caplog)
    assert "_demo_kernel [num_warps=4, num_ctas=1]" in msg
    assert "{'BLOCK': 128, 'PDL': True}" in msg and "divisible by 16: []" in msg
    # the closest earlier variant is the BLOCK 128 one: only X's alignment differs
    assert "against the closest variant compiled before: X: divisible by 16 -> not; launched from" in msg
    assert "tests/executor/test_compile_watch.py" not in msg  # only tokenspeed frames are named as the site


def test_difference_names_options_and_else_the_key() -> None:
    a = compile_watch.Variant("num_warps=4", {"B": 1}, ("X",), "k(4)")
    assert a.differences(a) == []
    assert compile_watch.Variant("num_warps=8", {"B": 1}, ("X",), "k(8)").differences(a) == [
        "options: num_warps=4 -> num_warps=8"]
    (diff,) = compile_watch.Variant("num_warps=4", {"B": 1}, ("X",), "k(i64)").differences(
        compile_watch.Variant("num_warps=4", {"B": 1}, ("X",), "k(i32)"))
    assert diff.startswith("cache key at 3:") and "'k(i32)' -> 'k(i64)'" in diff


def test_a_kernel_never_compiled_before_says_so(caplog) -> None:
    compile_watch.serving_started()
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        _fire(compile_watch.late_compile_hook())
    assert "no variant of this kernel was compiled before" in _warnings(caplog)[0]


def test_hook_chains_the_previous_one() -> None:
    seen = []
    hook = compile_watch.late_compile_hook(lambda **kw: seen.append(kw["repr"]) or "skip")
    assert _fire(hook) == "skip" and seen == ["_demo_kernel[num_warps=4, num_ctas=1](X: *bf16)"]


def test_watch_installs_through_tritons_knob(monkeypatch, caplog) -> None:
    knobs = pytest.importorskip("triton.knobs")
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(1))
    assert compile_watch.watch_compiles()
    assert compile_watch.watch_compiles()  # a second engine: installed once, so one warning per compile
    compile_watch.serving_started()
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        _fire(knobs.runtime.jit_cache_hook)
    assert seen == [1]
    assert len(_warnings(caplog)) == 1


def test_snapshot_and_new_variants() -> None:
    """What a test (or a profiler) compares across a step: the variants compiled since a snapshot, each with its
    difference from the closest one in the snapshot."""
    hook = compile_watch.late_compile_hook()
    _fire(hook)
    before = compile_watch.compiled_variants()
    assert compile_watch.new_variants(before) == []
    _fire(hook, warps=8)
    ((name, variant, diff),) = compile_watch.new_variants(before)
    assert name == "_demo_kernel" and variant.options.startswith("num_warps=8")
    assert diff == ["options: num_warps=4, num_ctas=1 -> num_warps=8, num_ctas=1"]
