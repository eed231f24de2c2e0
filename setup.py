"""Build step kept out of pyproject.toml: copy the top-level models.toml into the package.

`models.toml` lives at the repository's top level (one hand-edited copy); the installed package
must carry it too, so `build_py` copies it into `mlx_spec/` of every wheel. A source checkout or
an editable install reads the top-level file directly (see `mlx_spec.pairs.registry.builtin_file`).
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent


class BuildPyWithModels(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            target = Path(self.build_lib) / "mlx_spec" / "models.toml"
            self.copy_file(str(ROOT / "models.toml"), str(target))


setup(cmdclass={"build_py": BuildPyWithModels})
