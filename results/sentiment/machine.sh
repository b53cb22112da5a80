#!/usr/bin/env bash
# The machine and software a results/ figure was measured on (cores, CPU model, versions, commit).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
date -u
uname -a
nproc
lscpu | grep -E "^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\))" || true
.venv/bin/python -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__)"
.venv/bin/python -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>/dev/null || true
.venv/bin/python -c "import transformers as t; print('transformers', t.__version__)" 2>/dev/null || true
echo "commit $(git rev-parse HEAD)"
echo "uncommitted files in the working tree: $(git status --porcelain --untracked-files=no | wc -l)"
