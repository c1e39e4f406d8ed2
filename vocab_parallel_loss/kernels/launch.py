"""A fast path for ``kernel[grid](*args, **kwargs)``: launch the compiled kernel directly.

Triton's ``JITFunction.run`` binds the arguments, computes the specialization of each one and a
string cache key on every call (~20 us of host time). ``launch`` does that work once: the first
call of a specialization goes through ``kernel[grid]``, which returns the ``CompiledKernel``; later
calls with the same key call ``CompiledKernel.run`` with the arguments ``JITFunction.run`` would
pass.

The key holds everything Triton specializes on, or more (a finer key only costs a launch through
Triton):

* every keyword argument by name and value: the constexprs and the options (``num_warps``, ...);
* each positional tensor: its dtype and whether ``data_ptr() % 16 == 0``;
* each positional int: whether it is 1 (Triton makes it a constexpr), whether it is divisible by
  16, and its range (i32, i64 or u64 in the signature); a bool or a float: its type only;
* the current device (one compiled module per device).

The path is used only where it is known to be right: NVIDIA, a Triton release whose
``JITFunction.run`` launches with ``kernel.run(grid_0, grid_1, grid_2, stream, kernel.function,
kernel.packed_metadata, launch_metadata, enter_hook, exit_hook, *bound_args.values())`` (checked in
its source), and whose own specializer agrees with the key on probe values. It is off under
``TRITON_INTERPRET=1``, with ``VPL_FAST_LAUNCH=0``, and for any call while a launch hook (a
profiler), a pre-run hook or a stages-inspection hook is set.

A remembered launch (``launch_memo``) hands the launcher its pointer arguments as the ints
``data_ptr()`` gave for the alignment test, where the launcher's source shows that it takes them
as they are (``_takes_int_pointers``): for a tensor it would call ``data_ptr()`` again and ask the
driver about the address, per pointer and launch (1 us per launch of 5 pointers on the H200's
host; a ``"mean"`` forward, three launches, 5-6 us faster).

Compile options that Triton reads from its knobs (``TRITON_DEBUG``, instrumentation) are those of
the first launch of each key: changing them at run time needs ``VPL_FAST_LAUNCH=0``.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from typing import NamedTuple

import torch
import triton

from .. import settings

ENV = settings.FAST_LAUNCH

#: launches per path, for tests and benchmarks
counts = {"fast": 0, "triton": 0}

#: None: not decided yet (decided at the first launch, which needs the GPU driver)
_enabled = None if settings.flag(ENV, True) else False
_caches: dict = {}  # JITFunction -> {key: (launcher, function, packed_metadata, tail, kernel)}
_MAX_KEYS = 64  # per kernel; past it new keys go through Triton (never expected)
_I32 = 2**31
_U64 = 2**63
_driver = None  # (get_current_device, get_current_stream)
_int_pointers = False  # the launcher takes a pointer argument as a plain int (_takes_int_pointers)
_hook_owners: tuple = ()  # objects whose launch_enter_hook / launch_exit_hook must be unset
_knobs_runtime = None
_HookChain = None
_JITFunction = None


#: compile options every launch pins. FMA contraction: Triton 3.9 warns that 3.10 turns it off
#: by default; the kernels were tuned with it (the fused kernel is close to instruction-bound)
#: and their rounding tested with it, so a Triton upgrade must not change it silently.
PINNED = {"enable_fp_fusion": True}


@functools.lru_cache(maxsize=8)
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``, which size persistent grids; on the CPU (the
    interpreter) 2, so that small test shapes still run a program's loop over several rows."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def set_enabled(on: bool) -> None:
    """Turn the fast path on or off in this process (``VPL_FAST_LAUNCH=0`` sets it off)."""
    global _enabled
    _enabled = None if on else False


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``; returns nothing."""
    _launch(kernel, grid, args, kwargs)


class Bound(NamedTuple):
    """One fast launch, remembered so that a call with the same scalars can repeat it without
    building the key (see ``launch_memo``)."""

    kernel: object
    entry: tuple  # the cache entry: (run, function, packed_metadata, tail, compiled)
    device: int
    n_tensors: int  # the leading positional arguments that are tensors
    tensor_key: tuple  # their (dtype, 16-byte aligned) pairs
    scalars: tuple  # the positional arguments after them, by value


def launch_memo(memo, slot, kernel, grid, args, make_kwargs):
    """``kernel[grid](*args, **make_kwargs())``, repeating the launch remembered in ``memo[slot]``.

    ``memo`` is a dict owned by the caller (the loss keeps one per cached call plan). A
    remembered launch is repeated only when the device, the positional scalars (by value), and
    the dtype and alignment of every tensor are those it was made with; ``make_kwargs`` must then
    give the same keywords, which holds when they are a function of ``slot``, those scalars and
    those dtypes. Otherwise this is ``launch``, and the memo is refreshed.
    """
    bound = memo.get(slot)
    if bound is not None and _enabled and _relaunch(bound, grid, args):
        return
    kwargs = make_kwargs()
    found = _launch(kernel, grid, args, kwargs)
    if found is not None:
        entry, device = found
        n = 0
        while n < len(args) and isinstance(args[n], torch.Tensor):
            n += 1
        scalars = args[n:]
        if all(a.__class__ in (int, float, bool) for a in scalars):
            memo[slot] = Bound(kernel, entry, device, n,
                                 tuple((a.dtype, a.data_ptr() % 16 == 0) for a in args[:n]),
                                 scalars)


def _relaunch(bound, grid, args) -> bool:
    n = bound.n_tensors
    if args[n:] != bound.scalars or _hooks_set(bound.kernel):
        return False
    device = _driver[0]()
    if device != bound.device:
        return False
    ptrs = []  # what the launcher gets for the tensors: their addresses, or themselves
    for a, (dtype, aligned) in zip(args, bound.tensor_key):
        ptr = a.data_ptr()
        if a.dtype != dtype or (ptr % 16 == 0) != aligned:
            return False
        ptrs.append(ptr if _int_pointers else a)
    counts["fast"] += 1
    run, function, metadata, tail, _ = bound.entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    run(grid[0], g1, g2, _driver[1](device), function, metadata, None, None, None, *ptrs,
        *args[n:], *tail)
    return True


def _launch(kernel, grid, args, kwargs):
    """The launch; returns ``(cache entry, device)`` when it went through the fast path."""
    if _enabled is None:
        _decide()
    if not _enabled or type(kernel) is not _JITFunction or _hooks_set(kernel):
        counts["triton"] += 1
        kernel[grid](*args, **{**PINNED, **kwargs})
        return None
    try:
        device = _driver[0]()
        key = (device, _args_key(args), *kwargs.items())
        cache = _caches.get(kernel)
        entry = cache.get(key) if cache is not None else None
    except Exception:  # an argument the key cannot describe: Triton's launch
        key = entry = None
    if entry is None:
        counts["triton"] += 1
        compiled = kernel[grid](*args, **{**PINNED, **kwargs})  # the key need not hold PINNED
        if key is not None:
            try:
                _remember(kernel, key, compiled, len(args), kwargs)
            except Exception:  # not cached: this key keeps going through Triton
                pass
        return None
    counts["fast"] += 1
    run, function, metadata, tail, _ = entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    # the tensors themselves here: turning them into ints in Python costs more than the launcher
    # saves; a remembered launch has the ints at hand (_relaunch)
    # no hook is set (checked above): no launch metadata, no hooks, as JITFunction.run would
    run(grid[0], g1, g2, _driver[1](device), function, metadata, None, None, None, *args, *tail)
    return entry, device


def _args_key(args):
    key = []
    for a in args:
        cls = a.__class__
        if cls is int:
            # 1 becomes a constexpr; else divisibility by 16 and the signature type (i32/i64/u64)
            key.append(1 if a == 1 else (a % 16 == 0) + (2 if -_I32 <= a < _I32 else
                                                          4 if a < _U64 else 8))
        elif cls is float or cls is bool:
            key.append(cls)
        else:  # a tensor; anything else fails here and is never cached
            key.append(a.dtype)
            key.append(a.data_ptr() % 16 == 0)
    return tuple(key)


def _hooks_set(kernel) -> bool:
    for owner in _hook_owners:
        for hook in (owner.launch_enter_hook, owner.launch_exit_hook):
            if hook is not None and not (type(hook) is _HookChain and not hook.calls):
                return True
    if getattr(kernel, "pre_run_hooks", None):
        return True
    return getattr(_knobs_runtime, "add_stages_inspection_hook", None) is not None


def _remember(kernel, key, compiled, n_args, kwargs) -> None:
    """Cache ``compiled`` under ``key`` when the direct call can reproduce this launch."""
    cache = _caches.setdefault(kernel, {})
    if len(cache) >= _MAX_KEYS or compiled is None:
        return
    params = kernel.params
    # positional arguments must be run-time arguments (the key does not hold their values);
    # keyword ones must be constexprs (held by value) or options
    if n_args > len(params) or any(p.is_constexpr for p in params[:n_args]):
        return
    by_name = {p.name: p for p in params}
    if any(name in by_name and not by_name[name].is_constexpr for name in kwargs):
        return
    tail = []
    for p in params[n_args:]:
        if p.name in kwargs:
            tail.append(kwargs[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            return
    function = getattr(compiled, "function", None)
    metadata = getattr(compiled, "packed_metadata", None)
    run = getattr(compiled, "run", None)
    if function is None or metadata is None or run is None:
        return
    cache[key] = (run, function, metadata, tuple(tail), compiled)


def _decide() -> None:
    global _enabled
    try:
        _enabled = _supported()
    except Exception:  # anything unexpected: Triton's own launch, always right
        _enabled = False


def _supported() -> bool:
    """Whether this Triton launches the way ``launch`` reproduces (see the module docstring)."""
    global _driver, _hook_owners, _knobs_runtime, _HookChain, _JITFunction, _int_pointers
    if settings.interpreting() or not torch.cuda.is_available():
        return False
    if torch.version.hip is not None:  # AMD specializes pointers on more than alignment
        return False
    major, minor = (int(v) for v in re.match(r"(\d+)\.(\d+)", triton.__version__).groups())
    if not (major == 3 and 3 <= minor <= 9):
        return False
    from triton.compiler import CompiledKernel
    from triton.runtime import jit
    from triton.runtime.driver import driver

    src = re.sub(r"\s+", "", inspect.getsource(jit.JITFunction.run))
    launch_call = ("kernel.run(grid_0,grid_1,grid_2,stream,kernel.function,kernel.packed_metadata,"
                   "launch_metadata,")
    if launch_call not in src or not src.rstrip().endswith("*bound_args.values())returnkernel"):
        return False
    if "driver.active.get_current_stream(device)" not in src:
        return False
    active = driver.active
    if active.get_current_target().backend != "cuda":
        return False
    try:
        from triton import knobs
    except ImportError:
        knobs = None
    _knobs_runtime = getattr(knobs, "runtime", None)
    _HookChain = getattr(knobs, "HookChain", None)
    _hook_owners = tuple(o for o in (_knobs_runtime, CompiledKernel)
                         if o is not None and hasattr(o, "launch_enter_hook"))
    if not _specializer_agrees():
        return False
    _JITFunction = jit.JITFunction
    _driver = (active.get_current_device, active.get_current_stream)
    _int_pointers = _takes_int_pointers()
    return True


def _takes_int_pointers(folder=None) -> bool:
    """Whether this Triton's CUDA launcher takes a plain int for a pointer argument as is.

    For a tensor it calls ``data_ptr()`` and then asks the driver to check the address
    (``cuPointerGetAttribute``), per pointer and per launch; for an int it does neither. A
    remembered launch has read every tensor's ``data_ptr()`` already (for the alignment test)
    and the loss has checked that the tensors are CUDA tensors of one device, so passing those
    ints saves the launcher that work (Triton 3.3-3.9: the int branch comes first in its
    pointer extraction, in the C source checked here)."""
    if folder is None:
        from triton.backends import nvidia

        folder = os.path.dirname(nvidia.__file__)
    for name in ("driver.c", "driver.py"):  # the launcher's C source: a file (3.5+) or a template
        try:
            with open(os.path.join(folder, name)) as f:
                src = re.sub(r"\s+", "", f.read())
        except OSError:
            continue
        if re.search(r"if\(PyLong_Check\(obj\)\)\{+[^;{}]*=PyLong_AsUnsignedLongLong\(obj\);"
                     r"return", src):
            return True
    return False


def _specializer_agrees(device="cuda") -> bool:
    """Triton's specializer must not tell apart two probe values that share a key."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:  # Python specializer (3.3, 3.4): the rules the key mirrors
        return True
    x = torch.empty(64, dtype=torch.float32, device=device)
    probes = [0, 1, 2, 3, 15, 16, 32, -1, -16, 17, _I32 - 1, _I32, _I32 + 16, -_I32, -_I32 - 1,
              2**40, 2**40 + 1, _U64, _U64 + 16, 2**64 - 1, True, False, 0.0, 1.0, 2.5,
              x, x[1:], x[4:], x[8:], x[3:]]

    try:  # the backend JITFunction.run passes (its rules may add to the base ones)
        from triton.compiler import make_backend
        from triton.runtime.driver import driver
        backend = make_backend(driver.active.get_current_target())
    except Exception:
        backend = BaseBackend

    def spec(arg):
        try:
            out = native_specialize_impl(backend, arg, False, True, True)
        except TypeError:  # an older call convention, without the backend
            out = native_specialize_impl(arg, False, True, True)
        return tuple(out)

    seen = {}
    for p in probes:
        ours, theirs = _args_key((p,)), spec(p)
        if seen.setdefault(ours, theirs) != theirs:
            return False
    return True
