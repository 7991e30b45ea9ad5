"""Say so when a Triton kernel compiles after start-up, and how it differs from the variants compiled before.

The engine compiles every kernel variant it expects during the warm-up and the graph capture. A variant that is
first needed while serving compiles inside that step: about a second during which every stream stalls.
`watch_compiles()` (installed before the warm-up) records each variant a process compiles (a miss of Triton's
in-memory kernel cache, whether or not the on-disk cache then has it); after `serving_started()` each new one is
logged as a warning, with:
- its launch options and constexprs (integer arguments equal to 1 are among them);
- the arguments Triton specialised as divisible by 16 (pointers 16-byte aligned, integers multiples of 16);
- how it differs from the closest variant of the same kernel compiled before (constexprs, divisibility, options,
  else the first differing stretch of Triton's cache key);
- the tokenspeed call site that launched it.

The serving scripts also list the kernels that landed in the on-disk cache, without the call site. The hook runs
only on in-memory cache misses, never on a cached launch.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """One compiled variant of a Triton kernel, as the JIT cache hook sees it."""

    options: str  # the launch options: the bracket of Triton's repr ("num_warps=4, num_ctas=1, ...")
    constexprs: dict[str, object]  # by argument name (integer arguments equal to 1 included)
    divisible: tuple[str, ...]  # argument names specialised as divisible by 16
    key: str  # Triton's in-memory cache key (specialisation and options as text)

    def differences(self, other: Variant) -> list[str]:
        """What sets self apart from `other`, as "name: other's -> self's" phrases; [] when their keys are equal."""
        out = [f"{k}: {other.constexprs.get(k)!r} -> {v!r}" for k, v in self.constexprs.items()
               if other.constexprs.get(k, _MISSING) != v]
        out += [f"{k}: {v!r} -> absent" for k, v in other.constexprs.items() if k not in self.constexprs]
        mine, theirs = set(self.divisible), set(other.divisible)
        out += [f"{k}: not divisible -> divisible by 16" for k in sorted(mine - theirs)]
        out += [f"{k}: divisible by 16 -> not" for k in sorted(theirs - mine)]
        if self.options != other.options:
            out.append(f"options: {other.options} -> {self.options}")
        if not out and self.key != other.key:
            at = next((i for i, (a, b) in enumerate(zip(self.key, other.key, strict=False)) if a != b),
                      min(len(self.key), len(other.key)))
            out.append(f"cache key at {at}: {other.key[max(at - 40, 0):at + 40]!r} -> "
                       f"{self.key[max(at - 40, 0):at + 40]!r}")
        return out


_MISSING = object()
_compiled: dict[str, list[Variant]] = {}  # kernel name -> the variants this process compiled, in order
_serving = False  # set by serving_started(): from then on each new variant is logged


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


def _divisible(configs: list | None, arg_names: list[str]) -> tuple[str, ...]:
    """The argument names whose Triton attributes (configs[0]: path -> [[attribute, value], ...]) mark them
    divisible by 16."""
    attrs = configs[0] if configs else {}
    return tuple(sorted(name for name, a in _named(attrs, arg_names).items() if "divisibility" in str(a)))


def _closest(variant: Variant, earlier: list[Variant]) -> tuple[Variant | None, list[str]]:
    """The earlier variant with the fewest differences from `variant`, and those differences."""
    best: tuple[Variant | None, list[str]] = (None, [])
    for old in earlier:
        diff = variant.differences(old)
        if best[0] is None or len(diff) < len(best[1]):
            best = (old, diff)
    return best


def late_compile_hook(previous: Callable[..., object] | None = None) -> Callable[..., object]:
    """A `triton.knobs.runtime.jit_cache_hook` that records the variant and, once serving has started, logs it
    (see the module docstring); it defers to `previous` (a hook set before; its answer decides whether Triton
    skips the compile) and returns None itself, so compilation goes ahead."""

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # Triton's keyword names
        names = getattr(getattr(fn, "jit_function", None), "arg_names", [])
        kernel = getattr(fn, "name", None) or str(repr).split("[")[0]
        options = str(repr).split("[", 1)[-1].split("]", 1)[0]
        variant = Variant(options, _named(compile.get("constants") or {}, names),
                          _divisible(compile.get("configs"), names), str(key))
        earlier = _compiled.setdefault(kernel, [])
        if _serving:
            old, diff = _closest(variant, earlier)
            against = ("; against the closest variant compiled before: " + "; ".join(diff)) if old is not None \
                else "; no variant of this kernel was compiled before"
            logger.warning("Triton kernel variant compiled after start-up (its step stalls while it compiles): %s "
                           "[%s]; constexprs %s; divisible by 16: %s%s; launched from %s", kernel, options,
                           variant.constexprs, list(variant.divisible), against, _call_site())
        earlier.append(variant)
        if previous is not None:
            return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                            already_compiled=already_compiled)
        return None

    hook.late_compile_watch = True  # marks ours, so a second engine in the process does not install it again
    return hook


def watch_compiles() -> bool:
    """Install `late_compile_hook` as Triton's JIT cache hook (chaining any hook already set; once per process,
    however many engines start), recording from now on. False where the installed Triton has no such knob."""
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


def compiled_variants() -> dict[str, list[Variant]]:
    """A snapshot of the variants this process compiled while watched: kernel name -> variants, in order."""
    return {name: list(variants) for name, variants in _compiled.items()}


def new_variants(since: dict[str, list[Variant]]) -> list[tuple[str, Variant, list[str]]]:
    """The variants compiled after the snapshot `since` (`compiled_variants`), each as (kernel name, variant, its
    differences from the closest variant of that kernel in the snapshot; [] when the snapshot has none)."""
    out = []
    for name, variants in _compiled.items():
        earlier = since.get(name, [])
        for variant in variants[len(earlier):]:
            out.append((name, variant, _closest(variant, earlier)[1]))
    return out


def serving_started() -> None:
    """From now on each new variant is logged as a warning (the warm-up and the graph capture are over)."""
    global _serving
    _serving = True
