#!/usr/bin/env bash
# torchrun for a run that a scheduler may stop: arguments go to torchrun. The other launch scripts start
# their torchrun through this one.
#
# A SIGTERM (what Slurm and most schedulers send before preempting or at the time limit) reaches the
# workers and not torchrun: each worker trains on to its next log step, saves a checkpoint and exits 0,
# and then so do torchrun and this script. torchrun starts with SIGTERM ignored and does not handle it
# (its --signals-to-handle, here PET_SIGNALS_TO_HANDLE), because it would end with exit 1 and a traceback
# and kill the workers after its shutdown timeout; this script forwards a SIGTERM sent to it to the workers,
# every second until they end, so that one sent before they exist or while they import is not lost. Signalling
# every process of the job at once, as Slurm's --signal does, is fine too: a worker takes several SIGTERMs
# as one request. Ctrl-C (SIGINT) goes to torchrun, which forwards it: the workers save and exit, torchrun
# exits 1 and so does this script, which waits for it; LM_STOP_GRACE (default 600) is how many seconds torchrun
# then gives them before SIGKILL.
# torchrun runs as lm-torchrun (lm/torchrun.py): the same arguments, and a failed run ends on the workers'
# own error line rather than torchrun's traceback.
set -euo pipefail
trap '' TERM
export PET_SIGNALS_TO_HANDLE="SIGINT,SIGHUP,SIGQUIT" PET_SHUTDOWN_TIMEOUT="${LM_STOP_GRACE:-600}"
lm-torchrun "$@" &
launcher=$!
stop=0
trap 'stop=1' TERM
trap : INT  # Ctrl-C: torchrun tells the workers to save and stop; wait for them, not leave them running
while :; do
  if [ "$stop" = 1 ]; then
    # torchrun's children are the workers. Until lm has installed its handler a worker ignores SIGTERM (it is
    # still importing), and torchrun may not have started them yet (rendezvous): repeat until the run ends
    pkill -TERM -P "$launcher" || true
    sleep 1
    kill -0 "$launcher" 2>/dev/null || break
  else
    status=0
    wait "$launcher" || status=$?
    kill -0 "$launcher" 2>/dev/null || exit "$status"  # wait also returns when a trapped signal arrives
  fi
done
status=0
wait "$launcher" || status=$?
exit "$status"
