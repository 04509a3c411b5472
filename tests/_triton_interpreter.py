"""The Triton interpreter without its per-call cost of re-patching triton.language.

Under TRITON_INTERPRET=1 a kernel launch (GridExecutor.__call__) swaps the
builtins of the ``triton.language`` modules its kernel sees for interpreted ones
(``_patch_lang``), runs every program, and restores them. Every call of a
``@triton.jit`` helper inside the kernel (InterpretedFunction.__call__) calls
``_patch_lang`` again, which walks those modules with ``inspect.getmembers`` and
re-creates the same patches: about 2 ms a call. The sampler's kernels call small
helpers inside loops (tens of thousands of calls a test), and profiled under
triton 3.9 that walk was 37% of an interpreted sampler test's time.

The patch is idempotent (a builtin already swapped is not a builtin and is left
alone; the rest is set again to the same behaviour), and a helper's patch is
never restored by Triton, so inside a launch a module once patched stays
patched until the launch ends. ``install()`` makes a helper's call a no-op when
every language module it sees is already patched in the running launch, and
leaves every other call of ``_patch_lang`` (a launch, the first helper that sees
triton.language.core) to Triton. triton 3.6 to 3.9 share this structure; where
a future Triton lacks it, install() does nothing and the tests run as slowly as
before, never differently. Profiled on a split sampler test (triton 3.9): 112 s
before, 70 s after.
"""

from __future__ import annotations


def _language_modules(fn) -> frozenset[int]:
    """The ids of the modules ``_patch_lang(fn)`` patches: triton.language and
    triton.language.core where ``fn``'s module names them."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


class _NothingToRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Makes a jit helper's call inside a launch skip the re-patching; True when
    this Triton has the structure described above."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None:
        return False
    if getattr(patch_lang, "_fastrl_once", False):
        return True
    # One entry a launch in progress: None until the launch's own _patch_lang
    # (the first call inside GridExecutor.__call__), then the modules patched
    # so far.
    launches: list[frozenset[int] | None] = []
    launch = executor.__call__

    def launch_marked(self, *args, **kwargs):
        launches.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def patch_lang_once(fn):
        modules = _language_modules(fn)
        if launches and launches[-1] is not None and modules <= launches[-1]:
            return _NothingToRestore()
        scope = patch_lang(fn)
        if launches:
            # the launch's own patch, or a helper's of a module the launch's kernel
            # does not name (triton.language.core, seen by tl.sum and the other
            # jit functions of triton.language.standard): Triton never restores a
            # helper's patch, so it holds for the rest of the launch too
            launches[-1] = (launches[-1] or frozenset()) | modules
        return scope

    patch_lang_once._fastrl_once = True
    executor.__call__ = launch_marked
    interpreter._patch_lang = patch_lang_once
    return True
