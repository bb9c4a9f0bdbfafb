"""gpu-check step cupy: CuPy kernels and its memory pool under a gpushare quota.

Run as a process of a lease. Argument: the quota in bytes. Prints one JSON line last:
{"outcome": "PASS" | "FAIL" | "SKIP", "detail": "..."}.
"""

import sys

from gpu_check_common import judge, require

(cupy,) = require("cupy")

quota = int(sys.argv[1])
problems = []

add = cupy.RawKernel(
    r"""
extern "C" __global__ void add(const float* a, const float* b, float* c, int n) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}
""",
    "add",
)
n = 1 << 20
a = cupy.arange(n, dtype=cupy.float32)
b = cupy.ones(n, dtype=cupy.float32)
c = cupy.empty_like(a)
add(((n + 255) // 256,), (256,), (a, b, c, cupy.int32(n)))
if not bool((c == a + 1).all()):
    problems.append("RawKernel add gave a wrong result")
squared_diff = cupy.ElementwiseKernel("float32 x, float32 y", "float32 z", "z = (x - y) * (x - y)", "sq_diff")
if not bool((squared_diff(a, b) == (a - 1) ** 2).all()):
    problems.append("ElementwiseKernel gave a wrong result")
del a, b, c

pool = cupy.get_default_memory_pool()
chunk = 64 << 20
held = []
error = None
try:
    for _ in range(2 * quota // chunk + 2):
        held.append(cupy.empty(chunk, dtype=cupy.uint8))
except cupy.cuda.memory.OutOfMemoryError as e:
    error = e
except Exception as e:  # anything but OutOfMemoryError is the failure this step looks for
    problems.append(f"pool growth past the quota raised {type(e).__name__}: {e}")
grown = len(held) * chunk
if error is None and not problems:
    problems.append(f"the pool grew to {grown} bytes past the quota {quota} without an error")
if grown > quota:
    problems.append(f"the pool holds {grown} bytes, over the quota {quota}")
del held
pool.free_all_blocks()

detail = f"RawKernel and ElementwiseKernel correct; the pool grew to {grown >> 20} MiB of a {quota >> 20} MiB quota, then OutOfMemoryError"
judge(problems, detail)
