"""gpu-check step torch-eager: PyTorch eager training under a gpushare memory quota.

Run by gpushare-gpu-check as a process of a lease (LD_PRELOAD=libgpushare.so). Arguments:
the quota in bytes and a directory shared with the step. Prints one JSON line last:
{"outcome": "PASS" | "FAIL" | "SKIP", "detail": "..."}.
"""

import os
import sys
import time

from gpu_check_common import judge, require, verdict

(torch,) = require("torch")

quota, shared = int(sys.argv[1]), sys.argv[2]
if not torch.cuda.is_available():
    verdict("FAIL", "torch.cuda.is_available() is False under the interposer")

# The CUDA runtime creates its context here, through its private path, before any
# allocation: the step checks that the arbiter already knows this process.
torch.cuda.init()
torch.cuda.current_stream()
tmp = os.path.join(shared, "initialised.tmp")
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.rename(tmp, os.path.join(shared, "initialised"))
deadline = time.monotonic() + 30
while not os.path.exists(os.path.join(shared, "checked")):
    if time.monotonic() > deadline:
        verdict("FAIL", "the step never checked the registration")
    time.sleep(0.01)

problems = []
free, total = torch.cuda.mem_get_info()
if total != quota:
    problems.append(f"mem_get_info total {total} != quota {quota}")

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(2048, 256, device="cuda")
y = (x[:, :10].argmax(dim=1)).cuda()
losses = []
for _ in range(200):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
if not losses[-1] < losses[0] * 0.5:
    problems.append(f"the loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}")

oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
try:
    too_big = torch.empty(quota, dtype=torch.uint8, device="cuda")
    problems.append(f"an allocation of the whole quota ({quota} bytes) succeeded")
    del too_big
except oom:
    pass
except Exception as e:  # anything but OutOfMemoryError is the failure this step looks for
    problems.append(f"past the quota: {type(e).__name__}: {e}")

# After the refusal the process still works.
check = float((x @ x.T).trace().item())
if not check > 0:
    problems.append(f"after the out-of-memory error a matmul gave {check}")

detail = (
    f"mem_get_info total {total} (quota {quota}), loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
    f"past the quota: {oom.__name__}"
)
judge(problems, detail)
