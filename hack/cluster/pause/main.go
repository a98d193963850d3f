// The pod sandbox ("pause") process for the local real node: it holds a pod's namespaces and does nothing
// else. Built locally because no registry is reachable to pull registry.k8s.io/pause; it behaves like
// kubernetes' build/pause/linux/pause.c (exit 0 on SIGINT/SIGTERM, reap children as PID 1).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		os.Stdout.WriteString("pause (kvfleet local build)\n")
		return
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig == syscall.SIGCHLD {
			for {
				pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
			continue
		}
		os.Exit(0)
	}
}
