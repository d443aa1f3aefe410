"""The HTTP service (FastAPI on uvicorn) over a `Backend` (`backend.py`), and its dynamic
batcher (DESIGN §7). The single-process backend is `local.py`; the cluster's lives in
`m31.cluster`, which this package never imports (the command line picks one).

Imports FastAPI and uvicorn: install the `serve` extra. The core (`m31.engine`,
`m31.index`) does not need them.
"""
