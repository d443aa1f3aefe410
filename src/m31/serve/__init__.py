"""The HTTP service (FastAPI on uvicorn), its dynamic batcher and load test (DESIGN §7).

Imports FastAPI and uvicorn: install the `serve` extra. The core (`m31.engine`,
`m31.index`) does not need them.
"""
