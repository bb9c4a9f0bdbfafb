"""gpu-check step triton: a Triton kernel (vector add) under a gpushare lease.

Run as a process of a lease. Argument: the quota in bytes (unused). Prints one JSON line
last: {"outcome": "PASS" | "FAIL" | "SKIP", "detail": "..."}.
"""

from gpu_check_common import require, verdict

torch, triton = require("torch", "triton")
import triton.language as tl  # noqa: E402  present once triton is


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)


n = 98_432
x = torch.rand(n, device="cuda")
y = torch.rand(n, device="cuda")
out = torch.empty_like(x)
add_kernel[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK=1024)
torch.cuda.synchronize()
if torch.equal(out, x + y):
    verdict("PASS", f"vector add of {n} floats correct (triton {triton.__version__})")
verdict("FAIL", f"vector add wrong: max error {(out - (x + y)).abs().max().item()}")
