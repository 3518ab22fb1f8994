package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/agent"
)

// agentMain is a workload container's process (see package agent).
func agentMain(args []string) int {
	if len(args) < 1 {
		fmt.Fprintln(os.Stderr, "usage: hcsi-lab agent db|backup [flags]")
		return 2
	}
	role := args[0]
	fs := flag.NewFlagSet("agent "+role, flag.ContinueOnError)
	path := fs.String("path", "/data", "the container path of the volume")
	interval := fs.Duration("interval", 2*time.Second, "db: time between records")
	work := fs.Duration("work", 10*time.Second, "backup: how long a run works")
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	env, err := agent.EnvFromOS()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	switch role {
	case "db":
		err = agent.RunDB(ctx, env, *path, *interval)
	case "backup":
		err = agent.RunBackup(ctx, env, *path, *work)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "agent:", err)
		return 1
	}
	return 0
}
