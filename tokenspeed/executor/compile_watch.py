"""Say so when a Triton kernel compiles after start-up.

The engine compiles every kernel variant it expects during the warm-up and the graph capture. A variant that is
first needed while serving compiles inside that step: about a second during which every stream stalls. Once
`watch_late_compiles()` has run, each new variant a process compiles (a miss of Triton's in-memory kernel cache,
whether or not the on-disk cache then has it) is logged as a warning, with:
- its launch options and constexprs (integer arguments equal to 1 are among them);
- the arguments Triton specialised as divisible by 16 (pointers 16-byte aligned, integers multiples of 16): a
  variant that differs from the warm-up's only there comes from an argument's alignment;
- the tokenspeed call site that launched it.

Those are what tell a new variant from the one the warm-up compiled (the serving scripts also list the kernels that
landed in the on-disk cache, without the call site). The hook runs only on such misses, never on a cached launch.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable

logger = logging.getLogger(__name__)


def _call_site() -> str:
    """The innermost tokenspeed frames outside this module and the Triton kernels' wrappers: 'file:line fn' x 3."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/tokenspeed/" in f.filename
              and not f.filename.endswith("compile_watch.py")]
    return " <- ".join(f"{f.filename.split('/tokenspeed/')[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))


def _named(constants: dict, arg_names: list[str]) -> dict[str, object]:
    """Triton's constants keyed by argument path ((index,) or deeper) -> {argument name: value}."""
    out = {}
    for path, value in constants.items():
        idx = path[0] if isinstance(path, tuple) and path else path
        name = arg_names[idx] if isinstance(idx, int) and idx < len(arg_names) else str(path)
        out[name if not isinstance(path, tuple) or len(path) == 1 else f"{name}{list(path[1:])}"] = value
    return out


def _divisible(configs: list | None, arg_names: list[str]) -> list[str]:
    """The argument names whose Triton attributes (configs[0]: path -> [[attribute, value], ...]) mark them
    divisible by 16."""
    attrs = configs[0] if configs else {}
    return sorted(name for name, a in _named(attrs, arg_names).items() if "divisibility" in str(a))


def late_compile_hook(previous: Callable[..., object] | None = None) -> Callable[..., object]:
    """A `triton.knobs.runtime.jit_cache_hook` that logs the compile (see the module docstring) and defers to
    `previous` (a hook set before; its answer decides whether Triton skips the compile). Returns None itself, so
    compilation goes ahead."""

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # Triton's keyword names
        names = getattr(getattr(fn, "jit_function", None), "arg_names", [])
        constants = _named(compile.get("constants") or {}, names)
        logger.warning("Triton kernel variant compiled after start-up (its step stalls while it compiles): %s; "
                       "constexprs %s; divisible by 16: %s; launched from %s", repr, constants,
                       _divisible(compile.get("configs"), names), _call_site())
        if previous is not None:
            return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                            already_compiled=already_compiled)
        return None

    hook.late_compile_watch = True  # marks ours, so a second engine in the process does not install it again
    return hook


def watch_late_compiles() -> bool:
    """Install `late_compile_hook` as Triton's JIT cache hook (chaining any hook already set; once per process,
    however many engines start). False where the installed Triton has no such knob."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False
    if not getattr(runtime.jit_cache_hook, "late_compile_watch", False):
        runtime.jit_cache_hook = late_compile_hook(runtime.jit_cache_hook)
    return True
