"""Installs picasso_tf and builds custom_ops/*.cc into one TensorFlow op library.

The library is compiled with g++ against the TensorFlow found at build time
(tf.sysconfig flags, C++17) and lands at picasso_tf/ops/_picasso_ops.so, next to a
small _build_info.json recording that TensorFlow version so that the loader can say
when the two disagree. `pip install .` and `pip install -e .` both run this build;
`python setup.py build_ext --inplace` rebuilds in a checkout.
"""
import glob
import json
import os
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

LIBRARY = "picasso_tf.ops._picasso_ops"
SOURCES = sorted(glob.glob("custom_ops/*.cc"))
HEADERS = sorted(glob.glob("custom_ops/*.h"))


class BuildTensorFlowOps(build_ext):
    """Compiles each source in parallel with TensorFlow's flags, links one .so."""

    def get_ext_filename(self, fullname):
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext):
        import tensorflow as tf

        target = self.get_ext_fullpath(ext.name)
        sources = list(ext.sources)
        if not self.force and self._up_to_date(target, sources, ext.depends, tf.__version__):
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.makedirs(self.build_temp, exist_ok=True)
        cxx = os.environ.get("CXX", "g++")
        # Built on the machine that runs it, so tuning for the host CPU is safe;
        # PICASSO_CXXFLAGS overrides (e.g. "-O3" for a portable build).
        opt = shlex.split(os.environ.get("PICASSO_CXXFLAGS", "-O3 -march=native"))
        # -fno-math-errno lets GCC vectorise loops with sqrt (Adagrad/Adam/RMSprop rows);
        # -ffp-contract=off keeps a*b+c unfused, rounding like TF's own CPU kernels.
        opt += ["-fno-math-errno", "-ffp-contract=off"]
        cflags = tf.sysconfig.get_compile_flags() + ["-fPIC", "-Wall", "-Wno-sign-compare"]
        cflags += ["-Icustom_ops"] + opt

        def compile_one(source):
            obj = os.path.join(self.build_temp, os.path.basename(source) + ".o")
            cmd = [cxx, "-c", source, "-o", obj] + cflags
            self.announce(" ".join(cmd), level=2)
            subprocess.check_call(cmd)
            return obj

        jobs = max(1, min(len(sources), os.cpu_count() or 1))
        with ThreadPoolExecutor(jobs) as pool:
            objects = list(pool.map(compile_one, sources))
        link = [cxx, "-shared", "-o", target] + objects + tf.sysconfig.get_link_flags() + opt
        self.announce(" ".join(link), level=2)
        subprocess.check_call(link)
        info = {"tensorflow_version": tf.__version__, "sources": [os.path.basename(s) for s in sources]}
        with open(_info_path(target), "w") as f:
            json.dump(info, f, indent=1)

    def copy_extensions_to_source(self):
        """In-place and editable builds copy the library into the source tree; its build
        record goes with it."""
        super().copy_extensions_to_source()
        for ext in self.extensions:
            built = os.path.join(self.build_lib, self.get_ext_filename(ext.name))
            shutil.copyfile(_info_path(built), _info_path(self.get_ext_filename(ext.name)))

    @staticmethod
    def _up_to_date(target, sources, depends, tf_version):
        """Built from exactly these sources, for this TensorFlow, after their last change."""
        if not os.path.exists(target) or not os.path.exists(_info_path(target)):
            return False
        with open(_info_path(target)) as f:
            info = json.load(f)
        if info.get("tensorflow_version") != tf_version or \
                info.get("sources") != [os.path.basename(s) for s in sources]:
            return False
        return all(os.path.getmtime(s) <= os.path.getmtime(target) for s in sources + depends)


def _info_path(target):
    return os.path.join(os.path.dirname(target), "_build_info.json")


TOOLS = {
    "picasso-train": "picasso_tf.tools.train:main",
    "picasso-profile-graph": "picasso_tf.tools.profile_graph:main",
    "picasso-bench": "picasso_tf.tools.bench:main",
    "picasso-gen-data": "picasso_tf.tools.gen_data:main",
    "picasso-run": "picasso_tf.tools.launch:main",
}
# tensorflow-cpu and tensorflow[and-cuda] install the same module, so an extra cannot
# swap one for the other: PICASSO_TF_PACKAGE=gpu chooses the CUDA build at install time.
TENSORFLOW = ("tensorflow[and-cuda]==2.15.1" if os.environ.get("PICASSO_TF_PACKAGE") == "gpu"
              else "tensorflow-cpu==2.15.1")

setup(
    name="picasso_tf",
    version="0.1.0",
    description="PICASSO training backend for wide-and-deep recommendation models on TensorFlow 2.15",
    python_requires=">=3.11,<3.12",
    packages=["picasso_tf"] + ["picasso_tf." + p for p in (
        "ops", "graph", "passes", "embedding", "runtime", "data", "distributed", "profiling")]
    + ["picasso_tf.models", "picasso_tf.tools", "picasso_tf.tools.benchmarking"],
    package_dir={"picasso_tf": "picasso_tf", "picasso_tf.models": "models",
                 "picasso_tf.tools": "tools"},
    package_data={"picasso_tf.ops": ["_build_info.json"],
                  "picasso_tf.data": ["bundled/*", "bundled/*/*"],
                  "picasso_tf.models": ["README.md"]},
    ext_modules=[Extension(LIBRARY, sources=SOURCES, depends=HEADERS)],
    cmdclass={"build_ext": BuildTensorFlowOps},
    install_requires=[TENSORFLOW, "tensorflow-io==0.36.0", "numpy<2", "pyarrow<19"],
    extras_require={
        "test": ["pytest"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": [f"{n}={t}" for n, t in sorted(TOOLS.items())]},
)
