package main

import (
	"bufio"
	"errors"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// A SIGTERM sent to the outer hcsi-lab process alone (kill, a supervisor's
// timeout) must reach the lab it runs, which stops, reports and cleans up.
func TestSignalsReachTheLab(t *testing.T) {
	// The child stands for the lab: it exits 7 on SIGTERM and never otherwise.
	cmd := exec.Command("sh", "-c", `trap 'exit 7' TERM; echo ready; while :; do sleep 0.1; done`)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- runForwardingSignals(cmd) }()
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("the child did not start: %q, %v", line, err)
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 7 {
			t.Fatalf("the child ended with %v, want exit 7 from its SIGTERM trap", err)
		}
	case <-time.After(time.Minute):
		_ = cmd.Process.Kill()
		<-errc
		t.Fatal("the SIGTERM sent to this process never reached the child")
	}
}
