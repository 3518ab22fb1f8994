package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

func testEnv(t *testing.T) (Env, string) {
	vol := filepath.Join(t.TempDir(), "pods", "uid", "volumes", "kubernetes.io~csi", "pvc-1", "mount")
	if err := os.MkdirAll(vol, 0o750); err != nil {
		t.Fatal(err)
	}
	return Env{Mounts: map[string]string{"/data": vol}, Namespace: "ns", Pod: "db-0", Node: "node-0", Results: t.TempDir()}, vol
}

func runDB(t *testing.T, e Env, records int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- RunDB(ctx, e, "/data", time.Millisecond) }()
	testwait.For(t, fmt.Sprintf("the database to acknowledge %d records", records), time.Minute, func() bool {
		return Acknowledged(e.Mounts["/data"]) >= records
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestDBVerifiesAfterARestart(t *testing.T) {
	e, _ := testEnv(t)
	runDB(t, e, 5)
	runDB(t, e, 10) // a second incarnation checks and continues the first one's records
	evs, err := ReadEvents(e.Results)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 2 || !evs[0].OK || !evs[1].OK || evs[1].Records < 5 || evs[1].Volume != "pvc-1" {
		t.Fatalf("events %+v: want two passing checks of pvc-1, the second with the first run's records", evs)
	}
}

func TestDBCheckFiresOnALostRecord(t *testing.T) {
	e, vol := testEnv(t)
	runDB(t, e, 5)
	log := filepath.Join(vol, dbLog)
	data, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.SplitAfter(string(data), "\n")
	// Drop an acknowledged record in the middle, as a lost write would.
	if err := os.WriteFile(log, []byte(strings.Join(append(lines[:2:2], lines[3:]...), "")), 0o640); err != nil {
		t.Fatal(err)
	}
	_, _, ev := VerifyDB(vol, 5)
	if ev.OK || ev.Expected == "" || ev.Got == "" {
		t.Fatalf("a lost record passed the check: %+v", ev)
	}
}

// A database stopped between creating its log and its first
// acknowledgement confirmed nothing: its next start is a new database, not a
// failed check (a lab run on host nodes reported it as lost data).
func TestDBLogWithoutAnyAcknowledgementIsNoLoss(t *testing.T) {
	e, vol := testEnv(t)
	if err := os.WriteFile(filepath.Join(vol, dbLog), []byte("1 "+chain(genesis, 1)+"\n"), 0o640); err != nil {
		t.Fatal(err)
	}
	runDB(t, e, 3)
	evs, err := ReadEvents(e.Results)
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 1 || !evs[0].OK {
		t.Fatalf("events %+v: want one passing check", evs)
	}
	if n, _, ev := VerifyDB(vol, e.told()); !ev.OK || n < 3 {
		t.Fatalf("after the restart: %d records, %+v", n, ev)
	}
}

// Records the database acknowledged to others are lost when the volume
// comes back without the acknowledgement that covered them, or with an
// older one, even though the log on it checks out against what it holds.
func TestDBCheckFiresOnALostAcknowledgement(t *testing.T) {
	e, vol := testEnv(t)
	runDB(t, e, 5)
	told := e.told()
	if told < 5 {
		t.Fatalf("the database told %d records, want at least 5", told)
	}
	ack := filepath.Join(vol, dbAck)
	data, err := os.ReadFile(ack)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ack, []byte(fmt.Sprintf("2 %s\n", chain(chain(genesis, 1), 2))), 0o640); err != nil {
		t.Fatal(err)
	}
	if _, _, ev := VerifyDB(vol, told); ev.OK {
		t.Fatalf("an acknowledgement gone back from %q to record 2 passed: %+v", data, ev)
	}
	if err := os.Remove(ack); err != nil {
		t.Fatal(err)
	}
	if _, _, ev := VerifyDB(vol, told); ev.OK {
		t.Fatalf("a lost acknowledgement passed: %+v", ev)
	}
}

func TestBackupCheckFiresOnACorruptFile(t *testing.T) {
	e, vol := testEnv(t)
	e.Mounts["/backup"] = vol
	if err := os.WriteFile(e.latestFile(), []byte("42"), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := RunBackup(context.Background(), e, "/backup", 0); err != nil {
		t.Fatal(err)
	}
	if ev := VerifyBackup(vol); !ev.OK || ev.Records != 42 {
		t.Fatalf("the backup just written does not verify: %+v", ev)
	}
	f, err := os.OpenFile(filepath.Join(vol, backupFile), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("X"), 100); err != nil {
		t.Fatal(err)
	}
	f.Close()
	ev := VerifyBackup(vol)
	if ev.OK || ev.Expected == ev.Got {
		t.Fatalf("a corrupt backup passed the check: %+v", ev)
	}
	if err := RunBackup(context.Background(), e, "/backup", 0); err == nil {
		t.Fatal("the next backup run did not fail on the corrupt file")
	}
}
