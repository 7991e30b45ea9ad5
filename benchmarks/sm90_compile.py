"""The shared machinery of the offline sm_90 compile scripts (benchmarks/*_compile_sm90.py): catch a wrapper's
Triton launches instead of running them, compile a caught launch for sm_90 without a GPU, read its resources and
the PTX facts of the PDL protocol (tokenspeed/ops/triton/pdl.py).

    from sm90_compile import TARGET, catch_launches, compile_launch, cubin_usage   # benchmarks/ on sys.path

A script calls a tokenspeed wrapper on small CPU tensors inside `catch_launches`, which swaps the named JIT kernels
for recorders and forces `pdl.enabled`; each recorded `Launch` goes to `compile_launch` (or `pack_launch` +
`compile_packed`, to de-duplicate launches that compile to the same kernel), which derives the signature and
specialisations the JIT would (16-divisible strides, constant 1s, descriptor block shapes) and calls
`triton.compile` for `TARGET`. Needs no CUDA driver; do not set TRITON_INTERPRET. Use the Triton the GPU runs
(`pip install --target DIR triton==3.6.0`, then PYTHONPATH=DIR:benchmarks:.): a kernel that fails here fails there.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from tokenspeed.ops.triton import pdl

TARGET = GPUTarget("cuda", 90, 32)  # (backend, compute capability, threads per warp): an H100 / H200
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"  # Triton's own ptxas / cuobjdump
WAIT, TRIGGER = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
L2_BULK_PREFETCH = "cp.async.bulk.prefetch.L2.global"


class Launch(NamedTuple):
    """One caught `kernel[grid](*args, **kwargs)`: the JIT function (not the recorder), its grid as given (a tuple
    or a callable of the meta-parameters), the positional and keyword arguments as the wrapper passed them."""

    fn: Any
    grid: Any
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` appends a `Launch` instead of launching."""

    def __init__(self, fn: Any, calls: list[Launch]):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: self.calls.append(Launch(self.fn, grid, args, kwargs))


def _bindings(kernels: Mapping[ModuleType, Iterable[str]]) -> list[tuple[ModuleType, str, Any]]:
    """(module, name, kernel) for every place a named kernel is bound: its module as given, and every loaded
    tokenspeed.ops.triton module binding the same object under that name (a re-exported kernel, e.g.
    mla_decode's `_mla_combine_uv_kernel`, is launched through the module that defines it)."""
    found = {(id(m), n): (m, n, getattr(m, n)) for m, names in kernels.items() for n in names}
    homes = [m for key, m in list(sys.modules.items()) if key.startswith("tokenspeed.ops.triton") and m is not None]
    for m, n, f in list(found.values()):
        for home in homes:
            if vars(home).get(n) is f:
                found.setdefault((id(home), n), (home, n, f))
    return list(found.values())


def catch_launches(kernels: Mapping[ModuleType, Iterable[str]], call: Callable[[], object], *, pdl_on: bool = True,
                   drop_launch_pdl: bool = False, patches: Iterable[tuple[object, str, Any]] = ()) -> list[Launch]:
    """Run `call()` with the kernels `kernels[module]` (names of JIT functions in that module, and wherever a
    tokenspeed.ops.triton module re-binds the same object) replaced by recorders, and return their launches in
    order. `pdl.enabled` answers `pdl_on` for every device and family (so the `PDL` constexpr and
    `pdl.launch_kwargs`' `launch_pdl` follow it) and `pdl.hopper` True; `drop_launch_pdl` makes `pdl.launch_kwargs` return {} (the
    launch option left at its default). `patches`: further (object, attribute, value) set for the call only.
    Everything is restored on exit, also when `call()` raises; nothing is launched, the tensors are not touched
    by any kernel."""
    calls: list[Launch] = []
    swaps = [(m, n, _Recorder(f, calls)) for m, n, f in _bindings(kernels)]
    swaps.append((pdl, "enabled", lambda device, family="": pdl_on))
    swaps.append((pdl, "hopper", lambda device: True))  # the target is sm_90, whatever the tensors' device
    if drop_launch_pdl:
        swaps.append((pdl, "launch_kwargs", lambda device, family="": {}))
    swaps += list(patches)
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in swaps]
    try:
        for obj, name, value in swaps:
            setattr(obj, name, value)
        call()
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
    return calls


def pack_launch(fn: Any, args: tuple, kwargs: dict) -> tuple:
    """(options, signature, constexprs, attrs) of a launch of JIT function `fn` for `TARGET`, as the JIT derives
    them from the argument values (dtypes, 16-divisibility, constant 1s, constexprs, launch options). Equal
    results (past the options) compile to the same kernel."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    return fn._pack_args(backend, kwargs, bound, spec, opts)


def compile_packed(fn: Any, packed: tuple) -> Any:
    """`triton.compile` of JIT function `fn` for `TARGET` with `pack_launch`'s result; returns the compiled kernel
    (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata.shared` in bytes). Raises what the compiler raises."""
    options, signature, constexprs, attrs = packed
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def compile_launch(launch: Launch) -> Any:
    """`compile_packed(pack_launch(...))` of one caught launch."""
    return compile_packed(launch.fn, pack_launch(launch.fn, launch.args, launch.kwargs))


def _cuobjdump(kernel: Any, flag: str) -> str:
    """stdout of Triton's cuobjdump `flag` on the kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(_BIN / "cuobjdump"), flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def cubin_usage(kernel: Any) -> dict[str, int | None]:
    """{"regs": registers per thread, "stack": stack frame bytes (spills and local arrays)} from cuobjdump
    -res-usage on the cubin; None where cuobjdump does not report it."""
    usage = _cuobjdump(kernel, "-res-usage")
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return {"regs": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None}


def sass_hash(kernel: Any) -> str:
    """12 hex digits of a SHA-1 of the cubin's SASS (cuobjdump -sass, without the file-name headers): equal
    hashes, the same machine code."""
    sass = _cuobjdump(kernel, "-sass")
    sass = "\n".join(line for line in sass.splitlines() if not line.lstrip().startswith(("code for", "Fatbin")))
    return hashlib.sha1(sass.encode()).hexdigest()[:12]


def loop_usage(kernel: Any) -> dict[str, int]:
    """The largest backward-branch loop of the kernel's SASS (its main loop): {"loop_ins": instructions in it,
    "loop_reloads": local-memory loads (LDL, spill reloads) in it}; zeros when the SASS has no loop."""
    ins = []
    for line in _cuobjdump(kernel, "-sass").splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    best: list[str] = []
    for addr, text in ins:
        target = re.search(r"BRA\s+(0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [t for a, t in ins if int(target.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return {"loop_ins": len(best), "loop_reloads": sum("LDL" in t for t in best)}


def ptxas_usage(ptx: str) -> dict[str, int | None]:
    """{"regs": registers per thread (None if ptxas does not say), "spill_bytes": spill stores + loads bytes} from
    Triton's `ptxas -v` run again on the PTX for the arch of its `.target`."""
    arch = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([str(_BIN / "ptxas"), f"-arch={arch}", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", res)
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", res)]
    return {"regs": int(regs.group(1)) if regs else None, "spill_bytes": sum(spills)}


def wait_then_trigger(ptx: str) -> bool:
    """Whether the PTX has `griddepcontrol.wait` and its first `griddepcontrol.launch_dependents` comes after the
    first wait (the protocol's order: trigger right after the wait, never before)."""
    wait, trig = ptx.find(WAIT), ptx.find(TRIGGER)
    return 0 <= wait < trig


def has_griddepcontrol(ptx: str) -> bool:
    """Whether the PTX has any `griddepcontrol` instruction (a kernel compiled with PDL off must have none)."""
    return WAIT in ptx or TRIGGER in ptx


def loads_before_wait(ptx: str) -> list[str]:
    """The `ld.global*` opcodes (e.g. "ld.global.cg.v4.b32") ahead of the first `griddepcontrol.wait`, in order;
    [] when the PTX has no wait."""
    return re.findall(r"ld\.global[\w.:]*", ptx[:max(ptx.find(WAIT), 0)])


def failure_line(head: str, e: BaseException, limit: int) -> str:
    """The report line of a variant that did not compile: `head` then "FAILED <type>: <message, cut to limit>"."""
    return f"{head}FAILED {type(e).__name__}: {str(e)[:limit]}"


def _checked_build(job: tuple) -> tuple[dict, list[str]]:
    """(build(*variant), problems(it)), or ({}, [the error]) when the build fails (`report_builds`' worker)."""
    build, problems, variant = job
    try:
        r = build(*variant)
        return r, problems(r)
    except Exception as e:  # noqa: BLE001 - a failed build is a reported result
        return {}, [f"{type(e).__name__}: {str(e)[:600]}"]


def report_builds(variants: Mapping[str, tuple], build: Callable[..., dict], problems: Callable[[dict], list[str]],
                  usage: Callable[[dict], str]) -> int:
    """Build every named variant (`build(*variant)` -> a report dict) in a process pool, print a line a variant
    ("ok" / "FAIL", the name, usage(report), the problems) and "<n> failed"; returns the exit status (1 if any
    failed)."""
    names = list(variants)
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # builds are independent: use every core
        results = list(pool.map(_checked_build, [(build, problems, variants[n]) for n in names]))
    failed = 0
    width = max((len(n) for n in names), default=0)
    for name, (r, bad) in zip(names, results, strict=True):
        failed += bool(bad)
        print(f"{'FAIL' if bad else 'ok  '} {name:{width}} {usage(r) if r else ''} {'; '.join(bad)}")
    print(f"{failed} failed")
    return 1 if failed else 0

