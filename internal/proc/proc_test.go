package proc

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

func TestRestartKillStop(t *testing.T) {
	g, err := NewGroup(context.Background(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer g.Stop(time.Second)
	sleeper, err := g.Start(Spec{Name: "sleeper", Path: "/bin/sh", Args: []string{"-c", "echo started; exec sleep 60"}, Restart: true})
	if err != nil {
		t.Fatal(err)
	}
	once, err := g.Start(Spec{Name: "once", Path: "/bin/sh", Args: []string{"-c", "exit 3"}})
	if err != nil {
		t.Fatal(err)
	}
	testwait.For(t, "the one-shot process to be reported dead", 30*time.Second, func() bool { return g.Dead() != nil })
	if exited, err := once.Exited(); !exited || err == nil || !strings.Contains(g.Dead().Error(), "once") {
		t.Fatalf("once: exited %v err %v, group says %v", exited, err, g.Dead())
	}
	// The shell must have printed before it is killed, or the log cannot
	// show two starts.
	started := func(n int) func() bool {
		return func() bool {
			log, err := os.ReadFile(g.LogPath("sleeper"))
			return err == nil && strings.Count(string(log), "\nstarted\n") >= n
		}
	}
	testwait.For(t, "the first start in the log", 30*time.Second, started(1))
	first := sleeper.Pid()
	if first == 0 {
		t.Fatal("a running process has no pid")
	}
	if err := sleeper.Kill(); err != nil {
		t.Fatal(err)
	}
	testwait.For(t, "the killed process to be restarted", 30*time.Second, func() bool {
		exited, _ := sleeper.Exited()
		return sleeper.Starts() == 2 && !exited
	})
	if pid := sleeper.Pid(); pid == first || pid == 0 {
		t.Fatalf("the restarted process has pid %d, the killed one had %d", pid, first)
	}
	testwait.For(t, "the second start in the log", 30*time.Second, started(2))
	sleeper.Stop(time.Second)
	if exited, _ := sleeper.Exited(); !exited {
		t.Fatal("Stop did not end the process")
	}
	log, err := os.ReadFile(g.LogPath("sleeper"))
	if err != nil || strings.Count(string(log), "\nstarted\n") != 2 {
		t.Fatalf("log %q (%v): want two starts", log, err)
	}
}
