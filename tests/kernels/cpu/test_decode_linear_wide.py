"""The C++ decode linear built 16 lanes wide, AVX-512's width, on whatever machine runs the suite.

On an AVX-512 machine ``-march=native`` builds kernels/cpu/csrc/decode_linear.cpp with 16-float vectors: other
folds, other K tails, rows 13-16 in the dot-product tiles instead of the broadcast ones, 17-32 rows in two
vectors. The developers' machines have AVX2 only, so that logic would go untested there. This builds the
same source with ``XINSERVE_DECODE_LINEAR_LANES=16`` (each vector then spans two AVX2 registers) and checks
it against F.linear at every row count the three paths take. It checks the arithmetic and the indexing, not
AVX-512's instructions: those run only on an AVX-512 machine (docs/kernels-and-devices.md, "What runs where").
What can be checked without one is that the sources compile for it: a 16-lane ``if constexpr`` branch that did
not (``fold``) made the whole extension fail to build on every AVX-512 machine, silently leaving it on the
reference kernels.
"""

import hashlib
import shutil
import subprocess
import sysconfig

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.cpu.test_decode_linear import case  # x, weight, bias of a seeded random case
from xinserve.kernels.cpu import cpp_build

SOURCE = next(path for path in cpp_build.SOURCES if path.name == "decode_linear.cpp")
WIDE_FLAGS = [*cpp_build.CFLAGS, "-DXINSERVE_DECODE_LINEAR_LANES=16"]


@pytest.fixture(scope="module")
def wide():
    """The extension with only decode_linear, 16 lanes wide; built once per source and machine (~30 s) and
    cached beside the kernels' own build."""
    from torch.utils import cpp_extension

    text = SOURCE.read_text()
    key = hashlib.sha256(f"{text}\n{WIDE_FLAGS}\n{torch.__version__}\n{cpp_build.cpu_flags()}".encode()).hexdigest()
    build_dir = cpp_build._cache_dir() / f"decode_linear_wide_{key[:16]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    with cpp_build._build_lock(build_dir):
        return cpp_extension.load_inline(
            name=f"xinserve_decode_linear_wide_{key[:16]}", cpp_sources=[text], functions=["decode_linear", "decode_linear_lanes"],
            extra_cflags=WIDE_FLAGS, extra_ldflags=list(cpp_build.LDFLAGS), build_directory=str(build_dir),
            verbose=False)


# K: under one vector, a tail of 5 past 16 lanes, exact multiples; N: tails of the 4-row and 3-row blocks.
@pytest.mark.parametrize(("n_out", "k"), [(3, 7), (13, 37), (47, 256), (37, 300), (6, 1030)])
def test_every_row_count_of_the_three_paths_equals_f_linear(wide, n_out, k):
    # 1-12: dot-product tiles; 13-16: one 16-lane vector, still the dot-product tiles; 17-64: broadcast tiles
    # in 2-4 vectors; 65+: the dot-product tiles again
    for rows in [*range(1, 35), 47, 48, 49, 63, 64, 65, 70]:
        x, weight, bias = case(rows, n_out, k, seed=rows)
        for b in (None, bias):
            torch.testing.assert_close(wide.decode_linear(x, weight, b), F.linear(x, weight, b),
                                       atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_half_precision_weights_are_widened_sixteen_at_a_time(wide, dtype, tol):
    for rows in (1, 5, 13, 16, 17, 32, 33):
        x, weight, bias = case(rows, 47, 259, dtype, seed=rows)
        got = wide.decode_linear(x, weight, bias)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), F.linear(x.float(), weight.float(), bias.float()),
                                   atol=tol, rtol=tol)


def test_two_threads_split_the_blocks_alike(wide):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (4, 16, 24, 32):  # both tiles; a weight large enough for both threads to take blocks
            x, weight, bias = case(rows, 257, 512, seed=rows)
            torch.testing.assert_close(wide.decode_linear(x, weight, bias), F.linear(x, weight, bias),
                                       atol=2e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_the_wide_build_is_sixteen_lanes_and_the_native_build_the_machines_width(wide):
    # a build that ignored the flag would pass the tests above on 8 lanes
    assert wide.decode_linear_lanes() == 16
    from xinserve.kernels.cpu import cpp

    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    assert cpp._extension.decode_linear_lanes() == (16 if "avx512f" in flags else 8)


def test_the_sources_with_avx512_paths_compile_for_an_avx512_target():
    # skylake-avx512: AVX-512 F/BW/CD/DQ/VL, as x86-64-v4 (a name GCC knows from 6, that one only from 11).
    # The object code is checked (the register constraints of the empty asm statements bind only at code
    # generation), not run. Only the sources that branch on AVX-512.
    from torch.utils import cpp_extension

    compiler = shutil.which("g++") or shutil.which("c++")
    assert compiler, "the kernels need a C++ compiler; so does this check"
    includes = [flag for path in cpp_extension.include_paths() for flag in ("-isystem", path)]
    includes += ["-isystem", sysconfig.get_paths()["include"]]
    flags = [flag for flag in cpp_build.CFLAGS if flag != "-march=native"]
    sources = [path for path in cpp_build.SOURCES if "__AVX512" in path.read_text()]
    assert SOURCE in sources
    for path in sources:
        done = subprocess.run(
            [compiler, "-std=c++20", "-fPIC", "-march=skylake-avx512", *flags, "-DXINSERVE_OPS=xinserve_check",
             "-DTORCH_EXTENSION_NAME=xinserve_check", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes,
             "-c", "-o", "/dev/null", str(path)],
            check=False, capture_output=True, text=True, timeout=600)
        errors = [line for line in done.stderr.splitlines() if "error" in line]
        assert done.returncode == 0, f"{path.name} does not compile for AVX-512:\n" + "\n".join(errors[:10])
