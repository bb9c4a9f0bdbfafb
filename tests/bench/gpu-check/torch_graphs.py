"""gpu-check step torch-graphs: torch.cuda.graph and torch.compile(mode="reduce-overhead")
as a low-priority job while a high-priority job churns the token.

Run as a process of a lease. Argument: the quota in bytes. Prints one JSON line last:
{"outcome": "PASS" | "FAIL" | "SKIP", "detail": "..."}.
"""

from gpu_check_common import judge, require, verdict

(torch,) = require("torch")

if not torch.cuda.is_available():
    verdict("FAIL", "torch.cuda.is_available() is False under the interposer")

problems, seen = [], []
a = torch.randn(512, 512, device="cuda")
static_in = a.clone()

# Warm up on a side stream, as torch.cuda.graph requires.
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        torch.relu(static_in @ static_in)
torch.cuda.current_stream().wait_stream(side)

graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_out = torch.relu(static_in @ static_in)
replays = 50
for i in range(replays):
    static_in.copy_(torch.randn(512, 512, device="cuda"))
    graph.replay()
    expected = torch.relu(static_in @ static_in)
    if not torch.allclose(static_out, expected, rtol=1e-3, atol=1e-3):
        problems.append(f"graph replay {i} differs from eager")
        break
torch.cuda.synchronize()
seen.append(f"{replays} graph replays")


def f(t):
    return torch.sin(t) @ t + 1.0


try:
    import triton  # noqa: F401  torch.compile's GPU code generator
except ImportError:
    triton = None
if triton is None:
    seen.append("torch.compile not run: triton (its GPU backend) not installed")
else:
    compiled = torch.compile(f, mode="reduce-overhead")
    calls = 20
    for i in range(calls):
        t = torch.randn(256, 256, device="cuda")
        if not torch.allclose(compiled(t), f(t), rtol=1e-3, atol=1e-3):
            problems.append(f"compiled call {i} differs from eager")
            break
    torch.cuda.synchronize()
    seen.append(f"{calls} torch.compile(reduce-overhead) calls")

judge(problems, "; ".join(seen))
