"""`python -m m31.bench <what>`: `m31 bench <what>` without the installed `m31` script
(bench/gpu.sh on the GPU image: PyTorch, Triton, numpy and typer, nothing installed)."""

import sys

from m31.bench.cli import main

sys.exit(main())
