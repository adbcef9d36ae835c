#!/usr/bin/env bash
# Container entry point: reports the two settings that decide whether processes may take file descriptors
# from their siblings (kernel.yama.ptrace_scope and CAP_SYS_PTRACE; CUDA IPC of expandable-segment memory
# does that with pidfd_getfd), optionally lowers ptrace_scope, then runs the command.
#
#   docker compose up                                # compose.yaml: cap_add SYS_PTRACE, no sysctl change
#   SET_PTRACE_SCOPE=0 docker compose up             # honoured only in a privileged container (see below)
#   ENTRYPOINT_PROC_ROOT=/tmp/fake bash docker/entrypoint.sh CMD...   # tests: read a fake /proc tree
#
# Hardware: any Linux; takes milliseconds. ptrace_scope is not namespaced: setting it from a privileged
# container changes the host's value until reboot, which is why it happens only when asked for. The
# usual fix needs no privilege: `cap_add: [SYS_PTRACE]`, which also lifts Docker's seccomp block on
# pidfd_getfd (the host sysctl does not).
set -euo pipefail

proc_root="${ENTRYPOINT_PROC_ROOT:-/proc}"
scope_file="$proc_root/sys/kernel/yama/ptrace_scope"
status_file="$proc_root/self/status"
CAP_SYS_PTRACE=19
CAP_SYS_ADMIN=21

has_capability() {
  local capeff
  capeff="$(awk '/^CapEff:/ {print $2}' "$status_file")"
  [[ -n "$capeff" ]] && (( (16#$capeff >> $1) & 1 ))
}

if [[ -r "$scope_file" ]]; then
  scope="$(<"$scope_file")"
  echo "entrypoint: kernel.yama.ptrace_scope=$scope"
else
  scope=""
  echo "entrypoint: kernel.yama.ptrace_scope absent (Yama not active)"
fi

if has_capability "$CAP_SYS_PTRACE"; then
  echo "entrypoint: CAP_SYS_PTRACE present"
else
  echo "entrypoint: CAP_SYS_PTRACE absent: pidfd_getfd between sibling processes is blocked by Docker's" \
    "seccomp profile; add 'cap_add: [SYS_PTRACE]' (compose.yaml has it)" >&2
fi

if [[ -n "${SET_PTRACE_SCOPE:-}" ]]; then
  if [[ ! "$SET_PTRACE_SCOPE" =~ ^[0-3]$ ]]; then
    echo "entrypoint: SET_PTRACE_SCOPE must be 0, 1, 2 or 3, not '$SET_PTRACE_SCOPE'" >&2
    exit 2
  fi
  # A privileged container has every capability and a writable /proc/sys; an ordinary one has neither.
  if [[ -z "$scope" ]]; then
    echo "entrypoint: SET_PTRACE_SCOPE=$SET_PTRACE_SCOPE ignored: Yama is not active here" >&2
  elif has_capability "$CAP_SYS_ADMIN" && [[ -w "$scope_file" ]] \
    && { echo "$SET_PTRACE_SCOPE" > "$scope_file"; } 2>/dev/null; then
    echo "entrypoint: set kernel.yama.ptrace_scope=$SET_PTRACE_SCOPE (was $scope; this is the host's setting)"
  else
    echo "entrypoint: SET_PTRACE_SCOPE=$SET_PTRACE_SCOPE ignored: needs a privileged container" \
      "(privileged: true); or on the host: sudo sysctl -w kernel.yama.ptrace_scope=$SET_PTRACE_SCOPE" >&2
  fi
fi

if [[ $# -eq 0 ]]; then
  set -- bash
fi
exec "$@"
