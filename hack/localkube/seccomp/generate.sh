#!/usr/bin/env bash
# Regenerate bwrap-host.json: containerd's RuntimeDefault seccomp profile (the pinned
# CONTAINERD_VERSION, for a container without capabilities, as the Pods here run) plus the calls
# bubblewrap needs to make its sandbox inside a user-namespace Pod: clone with namespace flags,
# unshare, mount, umount2 and pivot_root. RuntimeDefault allows those only with CAP_SYS_ADMIN;
# the Pod's own user namespace (hostUsers: false) is what confines them (docs/sandbox-hosts.md).
#
#   hack/localkube/seccomp/generate.sh > hack/localkube/seccomp/bwrap-host.json
#
# The default profile depends on the architecture and the kernel version (a few calls are added
# only on newer kernels): generate on the machine class the nodes run.
set -euo pipefail
# shellcheck source=../lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
GO_BIN="$(localkube_go)"
dir="$(mktemp -d)"
trap 'rm -rf "${dir}"' EXIT
cat >"${dir}/go.mod" <<GOMOD
module localkube.invalid/seccomp

go 1.24.0
GOMOD
cat >"${dir}/main.go" <<'GO'
package main

import (
	"encoding/json"
	"os"

	"github.com/containerd/containerd/v2/contrib/seccomp"
	"github.com/opencontainers/runtime-spec/specs-go"
)

func main() {
	// No capabilities: the profile RuntimeDefault gives the Pods here (capabilities: drop ALL).
	spec := &specs.Spec{Process: &specs.Process{Capabilities: &specs.LinuxCapabilities{}}}
	profile := seccomp.DefaultProfile(spec)
	profile.Syscalls = append(profile.Syscalls, specs.LinuxSyscall{
		Names:  []string{"clone", "mount", "pivot_root", "umount2", "unshare"},
		Action: specs.ActAllow,
	})
	out := json.NewEncoder(os.Stdout)
	out.SetIndent("", "  ")
	if err := out.Encode(profile); err != nil {
		panic(err)
	}
}
GO
cd "${dir}"
GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0 "${GO_BIN}" get \
  "github.com/containerd/containerd/v2@${CONTAINERD_VERSION}" >&2
GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0 "${GO_BIN}" run .
