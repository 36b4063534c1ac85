// Command pause is the sandbox ("pause") process of the local node's Pods: it holds the Pod's
// namespaces, reaps children it inherits (shared PID namespace) and exits 0 on SIGINT/SIGTERM.
// Built statically by hack/images/build.sh; packaged as the image rollout.local/pause.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 16)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
