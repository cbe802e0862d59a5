# Stage timing for .ci/run (sourced): `stage NAME` ends the previous stage and starts
# NAME; `stage_end` ends the last one and prints every stage's time. A stage that fails
# is reported too (the EXIT trap), so a red run still says where its time went.
_stage_names=()
_stage_secs=()
_stage_name=""
_stage_start=0
_run_start=$SECONDS

_stage_close() {
  if [ -n "$_stage_name" ]; then
    local took=$((SECONDS - _stage_start))
    _stage_names+=("$_stage_name")
    _stage_secs+=("$took")
    echo "== stage done in ${took}s: $_stage_name"
    _stage_name=""
  fi
}

stage() {
  _stage_close
  _stage_name="$1"
  _stage_start=$SECONDS
  echo "== stage: $1"
}

stage_end() {
  _stage_close
  echo "== CI stages (seconds):"
  local i
  for i in "${!_stage_names[@]}"; do
    printf '%6d  %s\n' "${_stage_secs[$i]}" "${_stage_names[$i]}"
  done
  printf '%6d  total\n' "$((SECONDS - _run_start))"
}

_stage_on_exit() {
  local status=$?
  if [ -n "$_stage_name" ]; then
    echo "== stage FAILED (exit $status): $_stage_name"
    stage_end
  fi
}
trap _stage_on_exit EXIT
