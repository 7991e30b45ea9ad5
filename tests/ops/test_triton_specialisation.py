"""The specialisation policy of the Triton kernels (`tokenspeed/ops/triton/_utils.py`): an argument that counts the
rows, tokens, pairs or sequences of a step is never specialised, so a serving step of a new size does not compile a
new kernel variant mid-request (on an H200 each cost 1-2 s). Checked over every kernel of `tokenspeed.ops.triton`,
so a new kernel with such an argument fails here until it declares it; the MLA plan and KDA norm constexprs that
are derived from the step's shape are checked to fall into few classes."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import tokenspeed.ops.triton as triton_ops
from tests.ops.triton_env import INTERP  # noqa: F401  (sets up Triton first)
from tokenspeed.ops.triton.kda_decode import norm_rows
from tokenspeed.ops.triton.mla_decode import plan_block_seq

# Parameter names that hold a per-step count in these kernels.
COUNT_NAMES = {"T", "N", "R", "P", "n", "n_iter", "num_m", "n_rows", "max_blocks", "max_q"}
# Kernels where such a name is not a count: a model size, or a tensor (pointer) argument.
NOT_COUNTS = {
    "_gemv_fma_kernel": {"N"},  # N = the weight's rows; M (the batch rows) is specialised on purpose: graphs only
    "_gemv_dot_kernel": {"N"},
    "_stacked_gemv_kernel": {"N"},  # N = each group's weight rows (a model size); its row count T is unspecialised
    "_attn_res_split_kernel": {"P"},  # P: the partial-sum tensor
    "_attn_res_online_kernel": {"P"},
    "_attn_res_tile_kernel": {"P"},
    "_moe_gate_kernel": {"R"},  # R: the residual tensor
}


def _kernels() -> dict[str, object]:
    out = {}
    for info in pkgutil.iter_modules(triton_ops.__path__):
        mod = importlib.import_module(f"{triton_ops.__name__}.{info.name}")
        for name, obj in vars(mod).items():
            if name.endswith("_kernel") and hasattr(obj, "fn") and getattr(obj, "__module__", mod.__name__):
                out[f"{info.name}.{name}"] = obj
    return out


def _unspecialised(kernel) -> set[str]:
    """Names of the parameters a JIT kernel (or its interpreter stand-in) does not specialise."""
    listed = getattr(kernel, "do_not_specialize", None)
    if listed is None:  # InterpretedFunction keeps the decorator's keywords
        listed = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    params = list(inspect.signature(kernel.fn).parameters)
    return {params[p] if isinstance(p, int) else p for p in listed}


def test_count_arguments_are_not_specialised() -> None:
    kernels = _kernels()
    assert len(kernels) > 20  # the scan found the package's kernels
    missing = []
    for qual, kernel in kernels.items():
        name = qual.split(".")[-1]
        sig = inspect.signature(kernel.fn).parameters
        counts = {p for p, v in sig.items() if p in COUNT_NAMES and "constexpr" not in str(v.annotation)}
        counts -= NOT_COUNTS.get(name, set())
        if counts - _unspecialised(kernel):
            missing.append(f"{qual}: {sorted(counts - _unspecialised(kernel))}")
    assert not missing, "per-step counts must be in do_not_specialize:\n" + "\n".join(missing)


def test_shape_derived_constexprs_fall_into_few_classes() -> None:
    assert {plan_block_seq(n) for n in range(1, 17)} == {16}
    assert [plan_block_seq(n) for n in (17, 32, 33, 64)] == [32, 32, 64, 64]
    assert norm_rows(1, 1) == norm_rows(8, 8) == 1  # decode: one token per sequence
    assert {norm_rows(t, n) for n in range(1, 9) for t in range(n + 1, 4 * n + 300)} == {16}
