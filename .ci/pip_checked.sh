# Sourced by .ci/install_*.sh (which set PY): `pip_install_checked ARGS...` runs
# `$PY -m pip install ARGS` and fails when the install breaks a requirement that held before
# it, judged by `pip check` before and after. pip's own report after an install is off
# (--no-warn-conflicts) because it also reports requirements that were broken before, as an
# "ERROR": after .ci/install_sglang.sh, which installs SGLang without its CUDA torch,
# kernels and serving extras on purpose, some 40 of SGLang's requirements are unmet, and pip
# lists them all whenever an install adds a package SGLang requires (the `lmeval` extra adds
# datasets and python-dateutil). This check reports those as kept, and fails on new ones.
pip_install_checked() {
  local before after added kept
  before=$("$PY" -m pip check 2>&1 || true)
  "$PY" -m pip install --no-warn-conflicts "$@"
  after=$("$PY" -m pip check 2>&1 || true)
  added=$(comm -13 <(sort <<<"$before") <(sort <<<"$after") \
          | grep -v '^No broken requirements found' || true)
  if [ -n "$added" ]; then
    printf 'pip_install_checked: the install broke these requirements:\n%s\n' "$added" >&2
    return 1
  fi
  kept=$(grep -c ' requires ' <<<"$after" || true)
  if [ "$kept" -gt 0 ]; then
    echo "pip_install_checked: the install broke no requirement ($kept broken before it" \
         "still are: \`$PY -m pip check\` lists them)"
  fi
}
