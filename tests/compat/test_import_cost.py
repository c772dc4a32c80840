"""The compatibility layer costs nothing to those who do not use it, and little to those who do:
``import bagua`` does not load it, and loading it adds no third-party module (issue: "import time
of bagua unchanged")."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import bagua
before = set(sys.modules)
import bagua.torch_api
added = sorted(set(sys.modules) - before)
print(json.dumps({"loaded_by_bagua": "bagua.torch_api" in before, "added": added}))
"""


def test_import_bagua_does_not_load_the_adapter_and_the_adapter_adds_no_third_party_module():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert not report["loaded_by_bagua"]
    foreign = [m for m in report["added"]
               if not m.startswith(("bagua.torch_api", "bagua.distributed"))
               and m.split(".")[0] not in sys.stdlib_module_names]
    assert foreign == [], foreign
