"""`python -m mlx_spec` works like the `mlx-spec` console script."""

import sys

from .cli import main

sys.exit(main())
