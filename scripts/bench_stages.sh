# Shared by the bench_*.sh scripts (sourced): stage selection and wall-time logging.
# Needs STAGES (space-separated stage names) and B (the output folder) set by the caller.
has() { [[ " $STAGES " == *" $1 "* ]]; }
timed() {  # timed <label> <command...>: runs it, appends the wall time to $B/timings.txt
  local label=$1 start
  shift
  start=$(date +%s)
  "$@"
  echo "$label: $(( $(date +%s) - start )) s" | tee -a "$B/timings.txt"
}
