package sanity

import (
	"io"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// slowStartSocket serves a unix socket at dir/csi.sock that forwards every
// connection to target once connectDelay has passed. csi-test's Connect
// (v5.4.0 utils/grpcutil.go) dials without blocking and then waits for the
// channel's state to change from the one it reads first: a connection that
// is already Ready by then never changes, and the suite's first spec fails
// after a minute with "Connection timed out". The delay keeps the channel
// Connecting until csi-test waits for the change.
func slowStartSocket(t *testing.T, dir, target string) string {
	t.Helper()
	const connectDelay = 300 * time.Millisecond
	path := filepath.Join(dir, "csi.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { l.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer in.Close()
				time.Sleep(connectDelay)
				out, err := net.Dial("unix", target)
				if err != nil {
					return
				}
				defer out.Close()
				done := make(chan struct{}, 2)
				go func() { _, _ = io.Copy(out, in); done <- struct{}{} }()
				go func() { _, _ = io.Copy(in, out); done <- struct{}{} }()
				<-done
			}()
		}
	}()
	return "unix://" + path
}
