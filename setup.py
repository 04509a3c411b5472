"""Build and packaging of fastrl.

`pip install .` / `pip install -e .` configure CMake with the Ninja generator and
build the native extension fastrl._C (CPU kernels always; CUDA kernels when
CMake finds a CUDA toolkit). The Triton kernels in kernels/ install as the
subpackage fastrl.kernels. FASTRL_NO_NATIVE=1 skips the native build entirely
(the package then runs on the Triton and reference backends).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = Path(self.build_temp).resolve() / "cmake"
        build_temp.mkdir(parents=True, exist_ok=True)
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        cmake_args = [
            *generator,
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('FASTRL_BUILD_TYPE', 'Release')}",
        ]
        if os.environ.get("FASTRL_NO_CUDA") == "1":
            cmake_args.append("-DFASTRL_NO_CUDA=ON")
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.run(["cmake", str(ROOT), *cmake_args], cwd=build_temp, check=True)
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_temp, check=True)


ext_modules = [] if os.environ.get("FASTRL_NO_NATIVE") == "1" else [CMakeExtension("fastrl._C")]

setup(
    packages=["fastrl", "fastrl.bench", "fastrl.integrations", "fastrl.kernels"],
    package_dir={"fastrl": "fastrl", "fastrl.kernels": "kernels"},
    package_data={"fastrl": ["py.typed"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
