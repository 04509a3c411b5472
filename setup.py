"""Build and packaging of fastrl.

`pip install .` / `pip install -e .` configure CMake with the Ninja generator and
build the native extension fastrl._C (the CPU kernels). The Triton kernels in
kernels/ install as the subpackage fastrl.kernels. FASTRL_NO_NATIVE=1 skips the
native build entirely (the package then runs on the Triton and reference backends).

The CMake build directory persists across installs, under
build/cmake/<python>-<build type>/ in the source tree (`make clean`
removes it): reinstalling with nothing changed compiles nothing, and a change to
one csrc/ file recompiles that file only. That holds under pip's build isolation
too, where every install runs CMake, Ninja and pybind11 from a new temporary
directory: the cache is keyed on their versions, not their paths; pybind11's
headers are copied once per version to build/deps/ so that the compile lines do
not change; and CMake is re-run on every install, so the build rules name the
tools of this install, never a deleted one. The directory is wiped and
configured afresh when the Python, a tool's version or the CMake options change,
so a stale cache is never reused; and it is locked while a build runs, so that
two installs from one tree do not build in it at once.

pybind11 is located by this process (the one that imports the build
requirements: a virtual environment's, or pip's isolated one) and handed to CMake
as pybind11_DIR. CMake's Python3_EXECUTABLE is the interpreter's real path, which
in a virtual environment is the base interpreter: it provides the headers and the
extension suffix, and cannot import the environment's packages.
"""

import contextlib
import filecmp
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
        # The interpreter itself (python and python3 are one; a venv's is its base's):
        # only its headers and extension suffix matter, and the name must not vary.
        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={lib_dir}",
            f"-DPython3_EXECUTABLE={os.path.realpath(sys.executable)}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
        ]
        # What the cache depends on besides the sources: when any of it differs
        # from the last configure here, start from an empty directory. Versions,
        # not paths: pip's isolated build environment is a new directory each time.
        fingerprint = json.dumps(
            {"args": cmake_args, "cmake": _tool_version(cmake), "ninja": ninja and _tool_version(ninja),
             "pybind11": _pybind11_version()},
            sort_keys=True,
        )  # fmt: skip
        stamp = build_dir / "fastrl-configure.json"
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        build_dir.parent.mkdir(parents=True, exist_ok=True)
        with _locked(build_dir.parent / f"{build_dir.name}.lock"):
            if not (stamp.exists() and stamp.read_text() == fingerprint):
                shutil.rmtree(build_dir, ignore_errors=True)
                build_dir.mkdir(parents=True)
            # Configured on every install (about a second once the compiler checks
            # are cached), so that the build rules name this install's CMake and
            # Ninja; the compile lines stay the same, so nothing recompiles.
            tool_args = [*generator, f"-Dpybind11_DIR={_stable_pybind11_cmake_dir(ROOT / 'build' / 'deps')}"]
            subprocess.run([cmake, str(ROOT), *cmake_args, *tool_args], cwd=build_dir, check=True)
            stamp.write_text(fingerprint)
            # Ninja recompiles only the sources (and their headers) that changed.
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


def _tool_version(executable: str) -> str:
    """The first line ``executable --version`` prints (``cmake version 3.31.6``, ``1.13.0``)."""
    out = subprocess.run([executable, "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[0] if out.strip() else ""


def _import_pybind11():
    try:
        import pybind11
    except ImportError as exc:
        raise RuntimeError(
            f"building fastrl._C needs pybind11 importable by {sys.executable} (pip install 'pybind11>=2.10', "
            "or build with pip's default build isolation), or FASTRL_NO_NATIVE=1"
        ) from exc
    return pybind11


def _pybind11_version() -> str:
    return _import_pybind11().__version__


def _stable_pybind11_cmake_dir(deps: Path) -> Path:
    """pybind11's CMake package directory, from a copy of the pybind11 package under
    ``deps``/pybind11-<version>/ (made once per version). Its headers' path then does
    not change between installs, so neither do the compile lines, and Ninja does
    not recompile everything after an install from pip's temporary build
    environment."""
    pybind11 = _import_pybind11()
    package = Path(pybind11.__file__).resolve().parent
    cmake_dir = Path(pybind11.get_cmake_dir()).resolve()
    copy = deps / f"pybind11-{pybind11.__version__}" / "pybind11"
    if not (copy.parent / "complete").exists():
        shutil.rmtree(copy.parent, ignore_errors=True)
        shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
        (copy.parent / "complete").touch()
    return copy / cmake_dir.relative_to(package)


ext_modules = [] if os.environ.get("FASTRL_NO_NATIVE") == "1" else [CMakeExtension("fastrl._C")]

setup(
    packages=["fastrl", "fastrl._sharded", "fastrl.integrations", "fastrl.kernels", "fastrl.kernels.sampling"],
    package_dir={"fastrl": "fastrl", "fastrl.kernels": "kernels"},
    package_data={"fastrl": ["py.typed"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
