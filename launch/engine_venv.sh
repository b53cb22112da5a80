# Sourced by launch/setup_sglang.sh and launch/setup_vllm.sh: what every rollout engine's own venv gets beside the
# engine. install_verl_beside_engine VENV NAME: verl-hpc's runtime requirements (megatron-core, ...) with torch and
# the versions the engine pins held (a constraints file of what is installed now), this checkout on the path (a .pth;
# the verl._C that launch/setup_env.sh built there for the same Python and torch==2.13.0, not compiled twice) and the
# venv's `verl` command (what an installed verl-hpc's console script would be). NAME prefixes its error lines.
install_verl_beside_engine() {
  local venv="$1" name="$2" cons site
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  cons="$(mktemp)"
  "$venv/bin/python" -m pip freeze --disable-pip-version-check \
      | grep -i -E '^(torch|transformers|tokenizers|numpy)==' > "$cons"
  "${pip[@]}" -r "$ROOT/requirements.txt" -c "$cons"
  rm -f "$cons"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$venv/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '2.13.0' else 1)" \
      || { echo "$name: expected torch 2.13.0 in $venv (the version verl._C is built for)" >&2; return 1; }
  ls "$ROOT"/verl/_C*.so >/dev/null 2>&1 \
      || { echo "$name: expected verl._C built in $ROOT/verl (run launch/setup_env.sh first)" >&2; return 1; }
  echo "$ROOT" > "$site/verl_hpc_checkout.pth"
  # The guard matters: the engines start their processes with multiprocessing's spawn, which re-imports this script.
  printf '#!%s\nimport sys\nfrom verl.cli import main\nif __name__ == "__main__":\n    sys.exit(main())\n' \
      "$venv/bin/python" > "$venv/bin/verl"
  chmod +x "$venv/bin/verl"
}

# share_identical_files VENV [ENGINE_VENV ...]: the files VENV holds byte for byte as .venv or a finished engine venv
# does (torch 2.13.0's libraries in all three, triton's in both engine venvs: ~2.5 GB) become hard links to theirs;
# Python sources and bytecode stay its own (launch/link_identical_files.py). Run after the install is proven, before
# its stamp.
share_identical_files() {
  local venv="$1" other
  shift
  local sources=("$ROOT/.venv")
  for other in "$@"; do
    if compgen -G "$other/.verl-*.stamp" >/dev/null; then sources+=("$other"); fi
  done
  "$venv/bin/python" "$ROOT/launch/link_identical_files.py" "$venv" "${sources[@]}"
}
