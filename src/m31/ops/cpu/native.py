"""The cpu kernel's compiled helpers (`csrc/`), built on first use with the system C compiler.

In torch, the cpu kernel's steps 1 and 2 on an 8-bit table (`cpu_score_topk_int8`) are a dozen
small operations per block, each a pass over [B·E, n] products, and the per-op cost dominated.
`csrc/scan.c` does step 1 in one pass per block that touches only the eligible pairs, with
the torch ops' values bit for bit, `step2.c` step 2 in one pass over the survivors (another fp32
evaluation, with exponentials of its own, which its bounds allow for), and `pass.c`'s `m31_pass`
runs the steps over the whole table for one worker thread; `native.h` holds what they share.

It needs a C compiler (`$CC`, else `cc`) when first used: the library is built for this
machine's CPU (-march=native: AVX-512 or AVX2 loops where it has them, else plain loops that
the compiler vectorizes for it), its .c files in one compiler call, into a cache folder
(`$M31_CACHE/native`, default `~/.cache/m31/native`), named by a hash of the folder's .c and .h
files, the flags, the compiler and the CPU, so a change in any file or another machine builds
its own (in a second or two). Without a compiler, or with `M31_NATIVE=0`, `library()` is None
and the kernel keeps its torch path (the same answers, slower); the reason is logged once.

The functions release the GIL (ctypes does for every call), so the kernel's worker threads run
them in parallel; the threads of one call share their threshold through a mutex in the library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")  # its .c files, and the header they include
# IEEE fp32 as written: the values must be the torch path's bit for bit (see the source)
_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math")
_ARCH = ("-march=native",)

_p, _i64, _f, _d = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double


class PassArgs(ctypes.Structure):
    """The arguments of `m31_pass`, as its `m31_pass_args` struct lays them out (same names,
    types and order): pointers are addresses (`ptr`), the rest numbers."""

    _fields_ = [
        ("spans", _p),
        ("n_spans", _i64),
        ("block", _i64),
        ("x", _p),
        ("x_scale", _p),
        ("d", _i64),
        ("g", _p),
        ("g_scale", _p),
        ("gdim", _i64),
        ("per_ad", _p),
        ("scan_bias", _p),
        ("n_ads", _i64),
        ("w", _p),
        ("v_scale", _p),
        ("wq", _p),
        ("q_scale", _p),
        ("p_t", _p),
        ("coef", _p),
        ("n_req", _i64),
        ("n_exp", _i64),
        ("alpha", _f),
        ("shift_base", _d),
        ("eta_l", _f),
        ("kappa", _f),
        ("one_u", _f),
        ("u_2kappa", _f),
        ("mask_mode", _i64),
        ("mask", _p),
        ("mask_stride", _i64),
        ("mask_index", _p),
        ("refine_pairs", _i64),
        ("room", _i64),
    ]


_SIGNATURES = {
    "m31_scan_int8": (_i64, [_p, _p, _p, _i64, _i64, _p, _p, _p, _i64, _i64, _i64, _p, _i64, _p,
                             _i64, _p, _p, _p, _i64]),
    "m31_step2": (_i64, [_p, _p, _i64, _p, _p, _p, _i64, _i64, _p, _p, _i64, _d, _f, _f, _f, _f,
                         _p, _p, _p, _i64, _i64, _p, _p, _p, _p, _p]),
    "m31_exp": (None, [_p, _p, _i64, _i64]),
    "m31_shared_new": (_p, [_i64, _i64, _f, _f]),
    "m31_shared_free": (None, [_p]),
    "m31_shared_tau": (None, [_p, _p]),
    "m31_pass": (_i64, [_p, ctypes.POINTER(PassArgs), ctypes.POINTER(_p)]),
    "m31_pass_args_size": (_i64, []),
    "m31_cands_take": (None, [_p, _p, _p, _p]),
    "m31_cands_free": (None, [_p]),
    "m31_simd": (ctypes.c_char_p, []),
}  # fmt: skip


_MODES = {
    **dict.fromkeys(("1", "on", "true", "yes"), "on"),
    **dict.fromkeys(("0", "off", "false", "no"), "off"),
    "plain": "plain",
}
_override: str | None = None


def mode() -> str:
    """What is asked for: "on" (the default), "off" (the torch path) or "plain" (the portable
    loops even where the CPU has AVX-512 or AVX2: for tests and comparisons). Set by `use`, else
    by the environment variable M31_NATIVE (1, on, true, yes / 0, off, false, no / plain)."""
    if _override is not None:
        return _override
    value = os.environ.get("M31_NATIVE", "on").strip().lower()
    if value not in _MODES:
        raise ValueError(f"M31_NATIVE must be one of {', '.join(_MODES)}, got {value!r}")
    return _MODES[value]


@contextmanager
def use(wanted: str) -> Iterator[None]:
    """Within the block, calls that start take `wanted` ("on", "off" or "plain") whatever
    M31_NATIVE says (process-wide: for benchmarks and tests, not for concurrent callers)."""
    global _override
    if wanted not in ("on", "off", "plain"):
        raise ValueError(f"wanted must be 'on', 'off' or 'plain', got {wanted!r}")
    before, _override = _override, wanted
    try:
        yield
    finally:
        _override = before


def cache_dir() -> Path:
    """Where the builds go: $M31_CACHE/native (default ~/.cache/m31, as the text embeddings')."""
    return Path(os.environ.get("M31_CACHE", "~/.cache/m31")).expanduser() / "native"


@functools.cache
def _build(plain: bool) -> ctypes.CDLL | None:
    try:
        return _compile_and_load(("-DM31_PLAIN",) if plain else ())
    except (OSError, subprocess.SubprocessError) as err:  # a cache folder not writable, ...
        log.warning("the cpu kernel's compiled helpers are unavailable: %s", err)
        return None


def _cpu_identity() -> bytes:
    """What -march=native builds for: the CPU's model and flags (Linux), else the platform's
    word for it. A cache folder shared by machines with different CPUs then holds a build each."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            lines = [line for line in f if line.startswith((b"model name", b"flags"))]
        return b"".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()


def _source_files() -> list[Path]:
    """The library's files: the .c and .h files of SOURCES, by name."""
    return sorted(path for path in SOURCES.iterdir() if path.suffix in (".c", ".h"))


def _source_digest() -> bytes:
    """A hash of the library's files, each one's name and bytes: a change in any of them (the
    header, which the compiler reads through #include, too) is a new build."""
    digest = hashlib.sha256()
    for path in _source_files():
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.digest()


def _compile_and_load(defines: tuple[str, ...]) -> ctypes.CDLL | None:
    command = shlex.split(os.environ.get("CC", "cc"))  # a compiler and its own arguments
    compiler = shutil.which(command[0]) if command else None
    if compiler is None:
        log.warning("no C compiler (set CC): the cpu kernel's 8-bit path runs in torch ops")
        return None
    command[0] = compiler
    version = subprocess.run(
        [*command, "--version"], capture_output=True, text=True, check=False, timeout=60
    ).stdout
    sources = [str(path) for path in _source_files() if path.suffix == ".c"]
    digest = _source_digest()
    errors = []
    for flags in (_FLAGS + _ARCH + defines, _FLAGS + defines):  # some lack -march=native
        parts = [digest, " ".join(command + list(flags)).encode(), version.encode()]
        key = hashlib.sha256(b"\0".join([*parts, _cpu_identity()])).hexdigest()[:16]
        target = cache_dir() / f"m31_cpu_native-{key}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # build beside the target, then rename: concurrent builders never see a partial file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            try:
                done = subprocess.run(
                    [*command, *flags, "-o", tmp, *sources, "-lm"],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
            except subprocess.TimeoutExpired:
                done = subprocess.CompletedProcess([], 1, "", "the compiler ran past 300 s")
            if done.returncode != 0:
                os.unlink(tmp)
                errors.append(done.stderr.strip()[-2000:])
                continue
            os.replace(tmp, target)
        lib = ctypes.CDLL(str(target))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        if lib.m31_pass_args_size() != ctypes.sizeof(PassArgs):  # a mirror out of step
            raise RuntimeError(
                f"{SOURCES}: m31_pass_args is {lib.m31_pass_args_size()} bytes, "
                f"native.PassArgs {ctypes.sizeof(PassArgs)}: update one to the other"
            )
        return lib
    log.warning(
        "building %s failed, the cpu kernel's 8-bit path runs in torch ops:\n%s",
        SOURCES,
        "\n".join(errors),
    )
    return None


def library() -> ctypes.CDLL | None:
    """The compiled helpers, or None (no compiler, a failed build, or M31_NATIVE=0)."""
    wanted = mode()
    return None if wanted == "off" else _build(wanted == "plain")


def ptr(t: torch.Tensor | None) -> int | None:
    """The address of a contiguous CPU tensor's first element, for a call into the library."""
    if t is None:
        return None
    if not (t.is_cpu and t.is_contiguous()):  # (not t.device: 8x slower, a call per array)
        raise ValueError("the compiled helpers take contiguous CPU tensors")
    return t.data_ptr()
