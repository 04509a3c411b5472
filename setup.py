"""Build and packaging of fastrl.

`pip install .` / `pip install -e .` configure CMake with the Ninja generator and
build the native extension fastrl._C (the CPU kernels). The Triton kernels in
kernels/ install as the subpackage fastrl.kernels. FASTRL_NO_NATIVE=1 skips the
native build entirely (the package then runs on the Triton and reference backends).

The CMake build directory persists across installs, under
build/cmake/<python>-<build type>/ in the source tree (`make clean`
removes it): reinstalling with nothing changed compiles nothing, and a change to
one csrc/ file recompiles that file only. The directory is wiped and configured
afresh when the tools that configured it change (the Python, CMake, Ninja or
pybind11 paths, or the CMake options), so a stale cache is never reused; and it
is locked while a build runs, so that two installs from one tree do not build in
it at once.
"""

import contextlib
import filecmp
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (created) for the duration; a no-op where
    fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _replace(src: Path, dst: Path) -> None:
    """Copies ``src`` to ``dst`` unless they are already identical, through a
    temporary file and a rename: a process that has the old library loaded keeps
    its mapping instead of seeing the file truncated under it."""
    if dst.exists() and filecmp.cmp(src, dst, shallow=False):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
    os.close(fd)
    try:
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        build_type = os.environ.get("FASTRL_BUILD_TYPE", "Release")
        flavour = f"{sys.implementation.cache_tag}-{build_type.lower()}"
        build_dir = ROOT / "build" / "cmake" / flavour
        lib_dir = build_dir / "lib"
        cmake, ninja = _tool("cmake"), _tool("ninja")
        if cmake is None:
            raise RuntimeError("building fastrl._C needs CMake >= 3.18 (pip install cmake), or FASTRL_NO_NATIVE=1")
        generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
        cmake_args = [
            *generator,
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={lib_dir}",
            # The interpreter itself (python and python3 are one; a venv's is its base's):
            # only its headers and extension suffix matter, and the name must not vary.
            f"-DPython3_EXECUTABLE={os.path.realpath(sys.executable)}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
        ]
        # What the cache depends on besides the sources: when any of it differs
        # from the last configure here, start from an empty directory.
        fingerprint = json.dumps(
            {"args": cmake_args, "cmake": cmake, "pybind11": _pybind11_cmake_dir()},
            sort_keys=True,
        )
        stamp = build_dir / "fastrl-configure.json"
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        build_dir.parent.mkdir(parents=True, exist_ok=True)
        with _locked(build_dir.parent / f"{build_dir.name}.lock"):
            configured = stamp.exists() and stamp.read_text() == fingerprint
            if not configured:
                shutil.rmtree(build_dir, ignore_errors=True)
                build_dir.mkdir(parents=True)
                subprocess.run([cmake, str(ROOT), *cmake_args], cwd=build_dir, check=True)
                stamp.write_text(fingerprint)
            # Ninja re-runs CMake by itself when CMakeLists.txt changed, and
            # recompiles only the sources (and their headers) that changed.
            subprocess.run([cmake, "--build", ".", "--parallel", jobs], cwd=build_dir, check=True)
            built = lib_dir / Path(self.get_ext_filename(ext.name)).name
            if not built.exists():
                raise RuntimeError(f"the CMake build did not produce {built}")
            _replace(built, Path(self.get_ext_fullpath(ext.name)))

    def copy_extensions_to_source(self) -> None:
        # pip install -e: the library goes next to the sources, but only when it
        # changed, and never truncated under a process that has it loaded.
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            if not isinstance(ext, CMakeExtension):
                continue
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            _replace(Path(regular_file), Path(inplace_file))
        others = [ext for ext in self.extensions if not isinstance(ext, CMakeExtension)]
        if others:
            cmake_exts, self.extensions = self.extensions, others
            try:
                super().copy_extensions_to_source()
            finally:
                self.extensions = cmake_exts


def _tool(name: str) -> str | None:
    """The ``cmake`` / ``ninja`` executable of the PyPI package this build imports
    (pyproject's build requirement: pip's isolated build environment, or this
    Python's own packages with --no-build-isolation, whose bin/ is not on PATH in
    a virtual environment that is not activated), else the one on PATH."""
    try:
        module = __import__(name)
        directory = getattr(module, "CMAKE_BIN_DIR", None) or getattr(module, "BIN_DIR", None)
    except ImportError:
        directory = None
    return (shutil.which(name, path=directory) if directory else None) or shutil.which(name)


def _pybind11_cmake_dir() -> str:
    try:
        import pybind11
    except ImportError:
        return ""
    return pybind11.get_cmake_dir()


ext_modules = [] if os.environ.get("FASTRL_NO_NATIVE") == "1" else [CMakeExtension("fastrl._C")]

setup(
    packages=["fastrl", "fastrl.bench", "fastrl.integrations", "fastrl.kernels"],
    package_dir={"fastrl": "fastrl", "fastrl.kernels": "kernels"},
    package_data={"fastrl": ["py.typed"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
