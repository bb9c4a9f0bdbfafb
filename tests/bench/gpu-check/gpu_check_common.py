"""What every gpu-check script shares: how it reports and how it skips.

A script's last stdout line is its verdict, {"outcome": "PASS" | "FAIL" | "SKIP", "detail": ...},
which gpushare-gpu-check reads; a framework that is not installed is a SKIP naming it.
"""

import importlib
import json
import sys


def verdict(outcome, detail):
    print(json.dumps({"outcome": outcome, "detail": detail}))
    sys.exit(0)


def require(*modules):
    """Imports `modules` in order, or ends the script with SKIP naming the first missing one."""
    try:
        return [importlib.import_module(m) for m in modules]
    except ImportError as e:
        verdict("SKIP", f"{(e.name or str(e)).split('.')[0]} not installed")


def judge(problems, detail):
    """FAIL listing `problems` if there are any, else PASS with `detail`."""
    verdict("FAIL" if problems else "PASS", "; ".join(problems) if problems else detail)
