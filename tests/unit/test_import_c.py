"""`import verl._C` on its own (issue 14, row 6): the extension finds torch's libraries (an rpath) and
imports torch itself, with no `import torch` before it and no LD_LIBRARY_PATH."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_verl_c_alone(tmp_path):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": REPO}
    code = "import verl._C as c; import torch; print(c.cpu_num_threads() >= 1)"
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
